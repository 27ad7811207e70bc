"""``LongNetConfig``: the shape of a LongNet language model, its presets, JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from ..ops import validation

POSITIONS = ("rotary", "none")
# Elements a weight matrix may have: its bytes (8 each at most) must fit int64.
MAX_MATRIX_ELEMENTS = 2**60


@dataclass(frozen=True)
class LongNetConfig:
    """A decoder-only LongNet (see :class:`dilated_attention.models.LongNetLM`).

    ``vocab_size``: tokens are ints in ``[0, vocab_size)`` (256: bytes). ``dim``: the
    model width; ``heads`` split it (``dim % heads == 0``); ``ffn_dim``: the
    feed-forward width. ``segment_lengths``, ``dilation_rates``, ``mode``,
    ``head_offsets``: the causal dilated attention of every layer (see
    :func:`dilated_attention.dilated_attention`). ``dropout``: on attention
    probabilities and on each residual branch, in training mode. ``positions``:
    ``"rotary"`` (rotary embeddings of q and k at absolute positions, base
    ``rotary_base``) or ``"none"``. ``tie_embeddings``: the LM head reuses the token
    embedding matrix.
    """

    vocab_size: int = 256
    dim: int = 128
    depth: int = 2
    heads: int = 4
    ffn_dim: int = 512
    segment_lengths: tuple[int, ...] = (64, 128, 256)
    dilation_rates: tuple[int, ...] = (1, 2, 4)
    mode: str = "mixture"
    head_offsets: str = "interleaved"
    dropout: float = 0.0
    positions: str = "rotary"
    rotary_base: float = 10000.0
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        for name in ("vocab_size", "dim", "depth", "heads", "ffn_dim"):
            object.__setattr__(self, name, validation.check_positive_int(getattr(self, name), name))
        segs, rates = validation.check_branches(self.segment_lengths, self.dilation_rates)
        object.__setattr__(self, "segment_lengths", segs)
        object.__setattr__(self, "dilation_rates", rates)
        object.__setattr__(self, "mode", validation.check_mode(self.mode))
        object.__setattr__(self, "head_offsets", validation.check_head_offsets(self.head_offsets))
        object.__setattr__(self, "dropout", validation.check_dropout(self.dropout, "dropout"))
        object.__setattr__(self, "tie_embeddings", validation.check_flag(self.tie_embeddings, "tie_embeddings"))
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads})")
        for name, rows in (("vocab_size", self.vocab_size), ("dim", self.dim), ("ffn_dim", self.ffn_dim)):
            if rows * self.dim >= MAX_MATRIX_ELEMENTS:
                raise ValueError(
                    f"{name} x dim = {rows} x {self.dim} is a weight matrix of {rows * self.dim:.3g} elements, "
                    f"beyond what a tensor holds (2**60): use a smaller {name}"
                )
        if self.mode == "head_groups":
            validation.check_head_groups(self.heads, len(segs))
        object.__setattr__(self, "positions", validation.check_choice(self.positions, "positions", POSITIONS))
        if self.positions == "rotary" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head dim (dim / heads), got {self.head_dim}")
        object.__setattr__(
            self, "rotary_base", validation.check_number(self.rotary_base, "rotary_base", 1, low_open=True)
        )
        object.__setattr__(
            self, "layer_norm_eps", validation.check_number(self.layer_norm_eps, "layer_norm_eps", 0, low_open=True)
        )

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def max_segment(self) -> int:
        """The longest segment: the most past positions a token attends back over."""
        return max(self.segment_lengths)

    @property
    def gamma(self) -> float:
        """MAGNETO's initialisation gain for a decoder of ``depth`` layers: ``sqrt(log(2 * depth))``."""
        return math.sqrt(math.log(2 * self.depth))

    def replace(self, **changes) -> LongNetConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["segment_lengths"], d["dilation_rates"] = list(self.segment_lengths), list(self.dilation_rates)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> LongNetConfig:
        if not isinstance(d, dict):
            raise TypeError(f"a LongNetConfig comes from a dict, got {validation.type_name(d)}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown LongNetConfig field(s) {unknown}; the fields are {sorted(names)}")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> LongNetConfig:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"a LongNetConfig must be a JSON object: {exc}") from None
        return cls.from_dict(d)

    @classmethod
    def preset(cls, name: str, **changes) -> LongNetConfig:
        """One of :data:`PRESETS` (``tiny``, ``small``, ``paper_base``), with ``changes``."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a preset's name (a str), got {validation.type_name(name)}")
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; the presets are {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **changes})


PRESETS: dict[str, dict[str, Any]] = {
    # A CPU demo: about 0.4 M parameters, trains in a minute or two on 2 cores.
    "tiny": dict(dim=128, depth=2, heads=4, ffn_dim=512, segment_lengths=(64, 128, 256), dilation_rates=(1, 2, 4)),
    # About 3 M parameters; every branch attends over 512 selected positions, up to 16K back.
    "small": dict(
        dim=256,
        depth=4,
        heads=8,
        ffn_dim=1024,
        segment_lengths=(512, 2048, 8192, 16384),
        dilation_rates=(1, 4, 16, 32),
    ),
    # LongNet's base model (Ding et al. 2023, section 4.1): 768 dims, 12 layers, 12 heads.
    "paper_base": dict(
        dim=768,
        depth=12,
        heads=12,
        ffn_dim=3072,
        segment_lengths=(2048, 4096, 8192, 16384, 32768),
        dilation_rates=(1, 2, 4, 6, 12),
    ),
}
"""The named configurations :meth:`LongNetConfig.preset` starts from (the fields each
sets; the others keep their defaults): ``tiny`` (about 0.4 M parameters, a CPU demo),
``small`` (about 3 M) and ``paper_base`` (LongNet's base model)."""
