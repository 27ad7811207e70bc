"""Dilated attention inside Hugging Face ``transformers`` models, through their attention interface.

    from dilated_attention.integrations.transformers import register
    register("dilated", segment_lengths=[2048, 4096, 8192], dilation_rates=[1, 2, 4])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="dilated")

Every layer then runs causal dilated attention on its ``q, k, v``. Needs the ``hf``
extra (``transformers``); ``import dilated_attention`` never imports it.

What the function does with what ``transformers`` passes:

- ``(B, H, L, D)`` inputs go in as they are (``layout="bhnd"``); the output is
  ``(B, L, H, D)``, as the interface expects.
- Grouped-query attention (fewer key/value heads than query heads): the keys go in
  as they are; the engine shares each key/value head among its query heads without
  repeating it (a kernel call gathers a few key heads only where a branch's query
  heads map to key heads in a pattern no strided view expresses).
- ``scaling`` is the softmax scale, ``dropout`` the attention dropout (``transformers``
  passes 0 in eval mode).
- ``s_aux`` (attention sinks, GPT-OSS: one learned logit per head, ``(H,)``): each
  query's softmax (in ``mixture`` the one over all branches, in ``head_groups`` its
  head's branch) gets the sink as one more logit, with a value vector of zero, so the
  output is the dilated output times ``sigmoid(lse - sink)``; exact, with gradients
  to the sinks. An ``s_aux`` of another shape is refused.
- Causal only: a module with ``is_causal=False`` (an encoder, cross-attention) is
  refused.
- Full attention only: a layer whose ``config.layer_types`` entry is not
  ``full_attention`` (Llama 4's ``chunked_attention``, ``sliding_attention``, ...) is
  refused, as are the options that change what a layer computes: a
  ``sliding_window`` narrower than ``max(segment_lengths)`` (a wider one excludes no
  key a query attends to, and changes nothing), ``softcap``, ``head_mask``,
  ``position_bias``, ``sinks`` (per token), sparse key ``indices`` and
  ``block_indices``, packed ``cu_seq_lens_q/k``, ``output_attentions`` and 4-D masks
  (dilated attention forms no weight matrix and has its own sparsity).
- Positions come from the queries' ``position_ids``: key slot ``i`` is position
  ``position_ids[-1] - (Lk - 1 - i)``, so segments follow each sequence's own
  positions and the keys may be a window of the sequence (:class:`DilatedCache`).
  A left-padded row's first real token is position 0 (as ``generate`` numbers it);
  its padding attends to nothing and outputs 0. Without ``position_ids`` the keys
  are positions ``0 .. Lk - 1``. ``position_ids`` that do not count up by one along
  a row's tokens (packed sequences) are refused, as are keys that no longer reach
  back to where the first query's segments start (a cache that dropped them).
- The attention mask is the 2-D padding mask (``True`` = token), as ``transformers``
  builds it for this registration; a padded key at a position ``>= 0`` is the
  library's key padding (no effect at all).
- Each call gets only the keys from the earliest one its queries attend to, so a
  decode step costs ``O(max(segment_lengths))`` whatever the cache holds.
- A :class:`DilatedCache` goes to ``generate`` and to the model's forward as
  ``past_key_values=``, the name every supported ``transformers`` version takes. One
  that reaches the attention function unused (``cache=`` before ``transformers`` 5.24,
  which the model's forward does not take) raises a ``ValueError``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch

from .. import functional
from ..functional import dilated_attention
from ..ops import validation
from ..ops.finite import all_finite, nonfinite_rows
from ..ops.plan import window_start_needed
from ..utils.extras import MissingExtra, install_hint

try:
    from transformers import AttentionInterface, PretrainedConfig
    from transformers.cache_utils import Cache, DynamicSlidingWindowLayer
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingExtra(
        f"the transformers integration needs transformers >= 4.57 (the 'hf' extra): "
        f"{install_hint('hf', ['transformers>=4.57'])}"
    ) from exc

# name -> the options it was registered with
_REGISTERED: dict[str, dict] = {}
# Whether a cache layer's lazy_initialization takes the values too (transformers 5.x)
# or the keys alone (4.x).
_INITIALIZED_WITH_VALUES = len(inspect.signature(DynamicSlidingWindowLayer.lazy_initialization).parameters) > 2


def register(
    name: str = "dilated",
    *,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    mode: str = "mixture",
    head_offsets: str = "interleaved",
) -> str:
    """Register causal dilated attention with this configuration as ``transformers``
    attention implementation ``name`` (with the padding mask it needs); return
    ``name``. Registrations under different names coexist."""
    if not isinstance(name, str) or not name or name in ("eager", "sdpa", "flex_attention") or "flash" in name:
        raise ValueError(f"name must be a new attention implementation name such as 'dilated', got {name!r}")
    segs, rates = validation.check_branches(segment_lengths, dilation_rates)
    forward = functools.partial(
        dilated_attention_forward,
        segment_lengths=segs,
        dilation_rates=rates,
        mode=validation.check_mode(mode),
        head_offsets=validation.check_head_offsets(head_offsets),
    )
    options = dict(forward.keywords)
    AttentionInterface.register(name, forward)
    # The mask transformers builds for flash attention: None without padding, else the
    # 2-D padding mask (True = token) over the keys.
    AttentionMaskInterface.register(name, flash_attention_mask)
    _REGISTERED[name] = options
    return name


class _WindowLayer(DynamicSlidingWindowLayer):
    """``transformers``' sliding-window cache layer, which appends a few positions (a
    decode step) in place, in buffers with room to spare (half as many slots again as
    the call returns, so that moving the kept positions to new buffers costs ``O(1)``
    per position), where ``transformers`` concatenates the whole window every step; whose
    kept window never holds on to the memory of a long chunk it was cut from; and which
    knows whether its window holds a NaN or an infinity: each chunk is checked once as
    it arrives, so a step need not scan the whole window again."""

    # The position after the last chunk that held a NaN or an infinity (0: none did).
    _nonfinite_until = 0
    # (keys, values) buffers (B, H_kv, slots, D) whose slots [end - kept, end) hold the
    # kept positions, and the views of them this layer handed out as self.keys, self.values
    # (anything else there was put by transformers: reorder, crop, reset, offload).
    _buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    _end = 0
    _kept: tuple[torch.Tensor, torch.Tensor] | None = None
    # Whether the layer keeps every position until a crop (assisted generation; set by
    # transformers from 5.x on, whose layers set it per instance; 4.x has no such mode).
    record_past = False
    # Per batch row, the position of the row's slot 0 (None: not known), as the attention
    # function found it from position_ids; it holds while the kept keys are those this
    # layer last returned (_numbered): a reorder, crop or selection by transformers
    # replaces them, and the next call finds it anew.
    _offsets: list[int | None] | None = None
    _numbered: torch.Tensor | None = None
    # Shared by the layers of one DilatedCache (which sets it): whether a call failed
    # after some layers took its keys (the cache then refuses calls until reset).
    failed: list[bool]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self._nonfinite_until = 0
        _check_batch(self.keys, key_states)
        known = self._offsets if self._numbered is not None and self.keys is self._numbered else None
        length = key_states.shape[-2]
        in_place = length < self.sliding_window // 2 and not self.record_past
        if in_place and torch.is_grad_enabled():
            # Autograd may keep the returned views (for the queries' gradient too, with the
            # keys and values frozen), and a write into their buffers would invalidate
            # them: transformers' concatenation. generate runs without gradients.
            in_place = False
        # a step's few rows: one concatenation and one sum; a long chunk: a sum each, no copy
        finite = all_finite(key_states, value_states) if in_place else nonfinite_rows(key_states, value_states) is None
        if in_place:
            keys, values = self._append(key_states, value_states)
        else:
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            self._buffers = self._kept = None  # the kept positions are transformers' tensors now
            for name in ("keys", "values"):
                kept = getattr(self, name)
                if kept.untyped_storage().nbytes() > 2 * kept.numel() * kept.element_size():
                    setattr(self, name, kept.clone())
        if not finite:
            self._nonfinite_until = self.cumulative_length
        # Where the window starts, for models that pass no position_ids to their attention.
        keys.dilated_first_slot = self.cumulative_length - keys.shape[-2]  # type: ignore[attr-defined]
        # Whether every key and value of the returned window is finite.
        keys.dilated_finite = self._nonfinite_until <= keys.dilated_first_slot  # type: ignore[attr-defined]
        # Where the attention function checks and records the rows' numbering.
        keys.dilated_numbering = (self, known)  # type: ignore[attr-defined]
        self._numbered = self.keys
        return keys, values

    def reset(self) -> None:
        """Drop the kept positions and the buffers, as transformers 5.x's layers do
        (4.x zeroed them in place, which changed the windows handed out before), and
        keep only the window again: assisted generation turns on ``record_past`` and
        never off."""
        self.keys = self.values = None
        self.is_initialized = False
        self._buffers = self._kept = None
        self._offsets = self._numbered = None
        self.record_past = False
        super().reset()

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept positions and ``key_states, value_states`` ``(B, H_kv, L, D)`` after
        them, as views of the buffers, the new ones written in place."""
        if not self.is_initialized:
            self.lazy_initialization(*((key_states, value_states) if _INITIALIZED_WITH_VALUES else (key_states,)))
        length = key_states.shape[-2]
        self.cumulative_length += length
        old_keys, old_values = self.keys, self.values
        assert old_keys is not None and old_values is not None  # set by lazy_initialization
        kept = old_keys.shape[-2] if old_keys.dim() == 4 else 0  # transformers starts from an empty 1-D tensor
        ours = self._kept is not None and old_keys is self._kept[0] and old_values is self._kept[1]
        # buffers made in (or out of) inference mode cannot be written out of (or in) it
        stale = self._buffers is not None and self._buffers[0].is_inference() != torch.is_inference_mode_enabled()
        if self._buffers is None or not ours or stale or self._end + length > self._buffers[0].shape[-2]:
            need = kept + length
            shape = (*key_states.shape[:2], need + need // 2 + 1, key_states.shape[-1])
            fresh = [torch.empty(shape, dtype=new.dtype, device=new.device) for new in (key_states, value_states)]
            if kept:
                fresh[0][:, :, :kept].copy_(old_keys)
                fresh[1][:, :, :kept].copy_(old_values)
            self._buffers, self._end = (fresh[0], fresh[1]), kept
        held_keys, held_values = self._buffers
        start, self._end = self._end - kept, self._end + length
        # narrow: one operation where indexing takes several (a step counts operations)
        held_keys.narrow(2, self._end - length, length).copy_(key_states)
        held_values.narrow(2, self._end - length, length).copy_(value_states)
        keys, values = held_keys.narrow(2, start, self._end - start), held_values.narrow(2, start, self._end - start)
        stays = min(self.sliding_window - 1, kept + length)
        self.keys, self.values = (
            keys.narrow(2, keys.shape[2] - stays, stays),
            values.narrow(2, keys.shape[2] - stays, stays),
        )
        self._kept = (self.keys, self.values)
        return keys, values


class DilatedCache(Cache):
    """A ``transformers`` cache for a model running a registered dilated attention:
    every layer keeps only the last ``max(segment_lengths) - 1`` positions (a query
    never attends further back), so generation memory stays constant however long
    the text grows; a decode step's keys and values are written in place (buffers of
    half as many positions again as a call returns, and one), not concatenated. Pass it as
    ``past_key_values=`` to ``generate`` or to the model's forward (every supported
    ``transformers`` version takes that name; 5.24 renamed it ``cache=`` and still
    takes the old one, with a ``FutureWarning``).

    A cache belongs to the model it is built for, and refuses updates once that model
    runs another attention implementation.

    ``model``: the model (or its config) after ``set_attn_implementation(name)``;
    ``name``, if given, must be the registration the model's (text) config runs: any
    other attention reading this cache would see a sliding window, so it is refused.
    Built on ``transformers``' sliding-window cache layer; the attention function
    places the window from the queries' ``position_ids``."""

    def __init__(self, model, name: str | None = None):
        config = getattr(model, "config", model)
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"model must be a transformers model or config, got {validation.type_name(model)}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a registration's name (a str) or None, got {validation.type_name(name)}")
        config = config.get_text_config(decoder=True)
        running = config._attn_implementation
        name = running if name is None else name
        if name not in _REGISTERED:
            raise ValueError(
                f"{name!r} is not a dilated attention registration (registered: "
                f"{sorted(_REGISTERED)}): call register() and model.set_attn_implementation(name)"
            )
        _check_running(config, name)
        self._config, self._name = config, name
        # The layer keeps sliding_window - 1 positions; at least one (a window of 1 keeps all).
        self.window = max(2, max(_REGISTERED[name]["segment_lengths"]))
        layers: list = [_WindowLayer(sliding_window=self.window) for _ in range(config.num_hidden_layers)]
        self._failed = [False]
        for layer in layers:
            layer.failed = self._failed
        super().__init__(layers=layers)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """``transformers``' update, once the model is known to still run the registration
        (after ``set_attn_implementation("sdpa")`` the model would read the kept window
        as a sliding window)."""
        _check_running(self._config, self._name)
        longest = max(_REGISTERED[self._name]["segment_lengths"])
        if longest > self.window:  # checked here, before any layer takes the call's keys
            raise ValueError(
                f"this DilatedCache keeps the positions segments of up to {self.window} reach, and the "
                f"registration the model runs now has segments of {longest} (registered again?): "
                "build a new DilatedCache(model) for it"
            )
        if self._failed[0]:
            raise ValueError(
                "this DilatedCache holds part of a call that failed (the layers before the failure took its keys): "
                "reset() it and feed the sequence again, or build a new DilatedCache"
            )
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(
                f"this DilatedCache has {len(self.layers)} layers, for the model it was built for, and layer "
                f"{layer_idx} asks for one: a cache belongs to its model, build DilatedCache(model) for this one"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def reset(self) -> None:
        """Empty every layer (transformers' reset), and take calls again after one failed."""
        super().reset()
        self._failed[0] = False

    @property
    def nbytes(self) -> int:
        """Bytes of memory the keys and values hold on to."""
        return held_bytes(self)


def _check_running(config, name: str) -> None:
    """A ``ValueError`` unless ``config`` (a text config) runs attention ``name``."""
    running = config._attn_implementation
    if running != name:
        raise ValueError(
            f"the model runs attention implementation {running!r}, not {name!r}: call "
            f"model.set_attn_implementation({name!r}) before using a DilatedCache (another "
            "attention would read its kept window as a sliding window)"
        )


def held_bytes(cache: Cache) -> int:
    """Bytes of memory (whole storages, each counted once) the keys and values of a
    ``transformers`` cache hold on to: a :class:`DilatedCache`'s buffers too, which
    outlive the keys ``transformers`` replaces (a reorder of beam search, a crop) until
    the next step."""
    tensors = [getattr(layer, name, None) for layer in cache.layers for name in ("keys", "values")]
    tensors += [t for layer in cache.layers for t in (getattr(layer, "_buffers", None) or ())]
    held = [t for t in tensors if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    return sum(storages.values())


def dilated_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    mode: str,
    head_offsets: str,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``transformers`` attention function: ``query`` ``(B, H, Lq, D)``, ``key,
    value`` ``(B, H_kv, Lk, D)`` (the queries are the last ``Lq`` of the ``Lk`` key
    slots; the keys may be a window of the sequence, as :class:`DilatedCache` keeps),
    ``s_aux`` optional attention sinks ``(H,)`` -> ``((B, Lq, H, D), None)``. A call
    that fails once a :class:`DilatedCache` took its keys leaves the cache refusing
    further calls until it is reset (its layers would hold different positions)."""
    try:
        return _attention(
            module, query, key, value, attention_mask, dropout, scaling, is_causal,
            segment_lengths, dilation_rates, mode, head_offsets, s_aux, kwargs,
        )  # fmt: skip
    except Exception:
        numbering = getattr(key, "dilated_numbering", None)  # set by DilatedCache
        if numbering is not None:
            numbering[0].failed[0] = True
        raise


def _attention(
    module, query, key, value, attention_mask, dropout, scaling, is_causal,
    segment_lengths, dilation_rates, mode, head_offsets, s_aux, kwargs,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """:func:`dilated_attention_forward`'s work."""
    _refuse_unsupported(module, key, attention_mask, is_causal, kwargs, max(segment_lengths))
    _check_sinks(s_aux, query.shape[1])
    batch, _, num_queries, _ = query.shape
    num_keys = key.shape[2]
    mask = None if attention_mask is None else attention_mask.bool()
    if mask is not None and mask.shape != (batch, num_keys):
        raise ValueError(
            f"the padding mask has shape {tuple(mask.shape)}, expected (batch, keys) = {(batch, num_keys)}"
        )
    first_slot = getattr(key, "dilated_first_slot", 0)  # set by DilatedCache: the window's first slot
    first = _first_key_positions(kwargs.get("position_ids"), mask, batch, num_queries, num_keys, first_slot)
    numbering = getattr(key, "dilated_numbering", None)  # set by DilatedCache
    if numbering is not None:
        layer, known = numbering
        _check_numbering(layer, known, first, first_slot, num_keys - num_queries)
    _check_keys_reach_back(first, num_keys - num_queries, segment_lengths)
    options = dict(
        segment_lengths=segment_lengths,
        dilation_rates=dilation_rates,
        mode=mode,
        head_offsets=head_offsets,
        is_causal=True,
        softmax_scale=scaling,
        dropout_p=dropout,
        layout="bhnd",
    )
    keys_finite = getattr(key, "dilated_finite", False)  # set by DilatedCache
    # Under autocast, models pass keys and values of different dtypes (float32 rotary
    # keys, lower-precision values) that SDPA casts: so does dilated attention (a cast
    # may overflow to infinity: the keys are then scanned again).
    cast = validation.autocast_inputs(query, key, value)
    keys_finite = keys_finite and cast[1] is key and cast[2] is value
    query, key, value = cast
    out = _attend_rows(query, key, value, mask, first, segment_lengths, options, s_aux, keys_finite)
    return out.transpose(1, 2), None


# Options some models pass to their attention function that change what it computes,
# and which dilated attention does not implement: (option, what it is).
_REFUSED_OPTIONS = (
    ("softcap", "logit soft-capping"),
    ("head_mask", "a mask on the attention weights"),
    ("position_bias", "an additive position bias"),
    ("sinks", "per-token attention sinks"),
    ("indices", "a sparse selection of keys"),
    ("block_indices", "a sparse selection of key blocks"),
    ("cu_seq_lens_q", "packed sequences"),
    ("cu_seq_lens_k", "packed sequences"),
)
# The layer types (config.layer_types) whose layers are full causal attention.
_FULL_ATTENTION_LAYERS = ("full_attention", "attention")


def _refuse_unsupported(module, key, attention_mask, is_causal, kwargs, longest_segment: int) -> None:
    if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        raise ValueError(
            f"dilated attention is registered for causal self-attention only; "
            f"{type(module).__name__} is not causal (an encoder or cross-attention): use another "
            "attn_implementation for it"
        )
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True is not supported: dilated attention never forms the weights")
    _refuse_layer_type(module)  # before the window: a sliding layer is refused whatever its width
    window = kwargs.get("sliding_window")
    if window is not None and not (isinstance(window, int) and window >= longest_segment):
        raise ValueError(
            f"the model sets sliding_window={window if isinstance(window, int) else '...'}, narrower than "
            f"max(segment_lengths) = {longest_segment}: the window would drop keys that dilated attention "
            "attends to. Register segment lengths of at most the window, use a config without "
            "sliding_window, or another attn_implementation"
        )
    for option, meaning in _REFUSED_OPTIONS:
        if kwargs.get(option) is not None:
            shown = kwargs[option] if isinstance(kwargs[option], (bool, int, float)) else "..."
            raise ValueError(
                f"the model sets {option}={shown} ({meaning}), which dilated attention does not "
                f"implement: use a config without {option}, or another attn_implementation"
            )
    _refuse_unused_cache(key, kwargs)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"dilated attention takes the 2-D padding mask, got a {attention_mask.dim()}-D attention "
            "mask: register the function with register(), which sets the mask transformers builds"
        )


def _refuse_layer_type(module) -> None:
    """A layer whose ``config.layer_types`` entry is not full attention (chunked,
    sliding, ...) attends to other keys than dilated attention would: refused."""
    layer_types = getattr(getattr(module, "config", None), "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if not isinstance(layer_types, (list, tuple)) or not isinstance(index, int) or not 0 <= index < len(layer_types):
        return
    if layer_types[index] not in _FULL_ATTENTION_LAYERS:
        raise ValueError(
            f"layer {index} is a {layer_types[index]!r} layer (config.layer_types[{index}]), and dilated attention "
            "replaces full attention only: use a config with layer_types=['full_attention'] * num_hidden_layers, "
            "or another attn_implementation for this model"
        )


def _refuse_unused_cache(key, kwargs) -> None:
    """A :class:`DilatedCache` that reaches the attention function among the extra
    keyword arguments was not used by the model (its forward takes another name)."""
    for keyword in ("cache", "past_key_values"):
        if isinstance(kwargs.get(keyword), DilatedCache) and getattr(key, "dilated_first_slot", None) is None:
            raise ValueError(
                f"the model did not use the DilatedCache passed as {keyword}= (its forward takes the cache under "
                "another name, and passed it on unused): pass it as past_key_values=, which every supported "
                "transformers version takes"
            )


def _check_sinks(sinks, num_heads: int) -> None:
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.shape != (num_heads,)):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else validation.type_name(sinks)
        raise ValueError(
            f"s_aux (attention sinks) must be one logit per query head, shape ({num_heads},), got "
            f"{shape}: dilated attention supports per-head sinks only"
        )


def _first_key_positions(
    position_ids, mask, batch: int, num_queries: int, num_keys: int, first_slot: int = 0
) -> list[int]:
    """Per row, the sequence position of its first key slot, from the
    queries' ``position_ids`` (slot ``i`` is position ``first + i``): negative where a
    row's first token (position 0) comes after left padding; ``-2**62`` for a row
    with no real query (it outputs 0). Without ``position_ids`` the slots are the
    positions (from ``first_slot``, the window's start in a :class:`DilatedCache`)
    and left padding is refused: its rows' positions are unknown."""
    if position_ids is None:
        if mask is not None:
            leading = ~mask[:, 0] & mask.any(1)
            if bool(leading.any()):
                raise ValueError(
                    "this model passes no position_ids to its attention function, so the positions of a "
                    "left-padded row are unknown (segments follow each sequence's own positions): pad on the "
                    "right, or run each prompt alone"
                )
        return [int(first_slot)] * batch
    if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool:
        raise TypeError(f"position_ids must be integers (torch.long), got {position_ids.dtype}")
    if (
        position_ids.dim() not in (1, 2)
        or position_ids.shape[-1] != num_queries
        or (position_ids.dim() == 2 and position_ids.shape[0] not in (1, batch))
    ):
        raise ValueError(
            f"position_ids must have shape (batch, queries) = {(batch, num_queries)} or "
            f"(1, {num_queries}), got {tuple(position_ids.shape)}"
        )
    if num_queries == 1:  # a decode step: in Python, one transfer
        positions = position_ids.reshape(-1).tolist()
        positions = positions * batch if len(positions) == 1 else positions
        real_rows = [True] * batch if mask is None else mask[:, -1].tolist()
        return [p - (num_keys - 1) if real else NO_QUERY for p, real in zip(positions, real_rows, strict=True)]
    slots = torch.arange(num_keys - num_queries, num_keys, device=position_ids.device)
    first = position_ids.reshape(-1, num_queries).expand(batch, -1) - slots  # per query: its row's first slot
    real = None if mask is None else mask[:, num_keys - num_queries :].to(first.device)
    if real is None or bool(real.all()):  # every query real (a decode step): fewer operations
        row_first = first[:, :1]
        agree = first == row_first
        real = None
    else:
        row_first = first.gather(1, real.int().argmax(1, keepdim=True))  # at each row's first real query
        row_first = row_first.masked_fill(~real.any(1, keepdim=True), NO_QUERY)
        agree = (first == row_first) | ~real
    if num_queries > 1 and not bool(agree.all()):
        row = int((~agree.all(1)).nonzero()[0])
        raise ValueError(
            "position_ids must number each row's tokens consecutively (0, 1, 2, ... from its first token, or "
            "from its first slot); packed sequences and other positions are not supported (row "
            f"{row}: slot minus position = {sorted(set((-first[row][_all_or(real, row)]).tolist()))}). "
            "generate numbers tokens from attention_mask: pad on the left only (tokenizer.padding_side = "
            "'left'), with no 0 between a row's tokens"
        )
    return row_first.squeeze(1).tolist()


def _check_numbering(layer: _WindowLayer, known, first: list[int], first_slot: int, first_query_slot: int) -> None:
    """Refuse ``position_ids`` that do not continue a :class:`DilatedCache`'s numbering
    (a jump between calls, or a 0 in ``attention_mask`` that the numbering skipped: the
    kept keys would be renumbered), then record each row's: ``known`` from the calls
    before, ``first`` this call's first-key positions, from cache slot ``first_slot``."""
    offsets = [None if position == NO_QUERY else position - first_slot for position in first]
    if known is not None and len(known) == len(offsets):
        for row, (was, now) in enumerate(zip(known, offsets, strict=True)):
            if was is not None and now is not None and was != now:
                slot = first_slot + first_query_slot
                raise ValueError(
                    f"position_ids of row {row} number its next token {now + slot}, where the tokens the cache "
                    f"holds make it {was + slot}: number each row's tokens consecutively across calls (with no "
                    "jump, and counting a 0 in attention_mask as a slot), or reset() the cache to start anew"
                )
        offsets = [was if now is None else now for was, now in zip(known, offsets, strict=True)]
    layer._offsets = offsets


def _check_batch(kept: torch.Tensor | None, key_states: torch.Tensor) -> None:
    """A ``ValueError`` where a call feeds another batch than the cache holds: its rows
    would be spread over the new ones (transformers' own cache refuses it too)."""
    if isinstance(kept, torch.Tensor) and kept.dim() == 4 and kept.shape[2] and kept.shape[0] != key_states.shape[0]:
        raise ValueError(
            f"this DilatedCache holds {kept.shape[0]} sequences and the call feeds {key_states.shape[0]}: feed "
            "the batch it was filled with, reset() it (or build a new one) for another batch, or select or "
            "repeat its rows first (batch_select_indices, batch_repeat_interleave)"
        )


def _all_or(real: torch.Tensor | None, row: int):
    """Row ``row``'s real queries as an index: all of them where ``real`` is ``None``."""
    return slice(None) if real is None else real[row]


NO_QUERY = -(2**62)  # the first-key position of a row whose queries are all padding


def _check_keys_reach_back(first: list[int], first_query_slot: int, segment_lengths) -> None:
    """Every row's keys must start where its first query's segments start (or before)."""
    for row, position in enumerate(first):
        query = position + first_query_slot
        if position > 0 and position > window_start_needed(query, segment_lengths):
            raise ValueError(
                f"row {row}: the keys start at position {position}, but the query at position {query} attends "
                f"from position {window_start_needed(query, segment_lengths)}: the cache dropped keys still "
                "needed (use DilatedCache, which keeps max(segment_lengths) - 1 of them), or position_ids do "
                "not start at 0"
            )


def _attend_rows(
    query, key, value, mask, first: list[int], segment_lengths, options, sinks=None, keys_finite: bool = False
) -> torch.Tensor:
    """``(B, H, Lq, D)``. Rows whose keys start at a position ``>= 0`` go in one call
    (per-row ``key_offset``); rows whose first token follows ``p`` padding slots
    (``first = -p``) in one call per ``p``, their padding queries 0. Each call reads
    only the keys from the earliest one its queries attend to, slot ``drop`` (a decode
    step attends to fewer than ``max(segment_lengths)``, however many the cache holds). Padded
    keys at positions ``>= 0`` are the library's key padding. ``sinks`` ``(H,)``
    enter each call's softmax (:func:`_with_sinks`)."""
    num_queries, num_keys = query.shape[2], key.shape[2]
    first_query_slot = num_keys - num_queries
    starts = first
    groups = [[row for row, start in enumerate(starts) if start >= 0]]
    groups += [
        [row for row, s in enumerate(starts) if s == start] for start in sorted(set(starts)) if NO_QUERY < start < 0
    ]
    groups = [rows for rows in groups if rows]
    every_row = len(groups) == 1 and len(groups[0]) == len(starts)  # in one call (none without a real query)
    out = None if every_row else query.new_zeros(query.shape)
    for rows in groups:
        # slot of the earliest key a query of these rows attends to (positions < 0 are padding)
        drop = min(
            window_start_needed(max(starts[row] + first_query_slot, 0), segment_lengths) - starts[row] for row in rows
        )
        skip = -min(starts[rows[0]], 0)  # padding slots before the first token
        if skip and (mask is None or bool(mask[rows, :skip].any())):
            raise ValueError(
                "position_ids put a row's first token after key slots that are not marked as padding: the keys "
                "run past the queries (a static cache?: use DilatedCache or transformers' default dynamic cache) or "
                "the mask and position_ids disagree (right padding or a 0 between a row's tokens in "
                "attention_mask: pad on the left only (tokenizer.padding_side = 'left'))"
            )
        if drop >= num_keys:
            continue  # only padding queries: they output 0
        picked = None if every_row else torch.tensor(rows, device=query.device)
        q, k, v, m = (t if picked is None or t is None else t[picked] for t in (query, key, value, mask))
        queries = slice(max(drop - first_query_slot, 0), num_queries)
        q = q if queries.start == 0 else q[:, :, queries]
        result = _attend_group(q, k, v, m, drop, [starts[row] for row in rows], options, sinks, keys_finite)
        if every_row and queries.start == 0:  # every row and every query: the call's output as it is
            return result
        if out is None:  # the rows' first queries are padding (one padding length for all): they output 0
            out = query.new_zeros(query.shape)
        out[slice(None) if picked is None else picked, :, queries] = result
    assert out is not None  # every row in one call, with no query cut, returned above
    return out


def _attend_group(
    q, k, v, mask, drop: int, offsets: list[int], options, sinks=None, keys_finite: bool = False
) -> torch.Tensor:
    """``(B, H, Lq, D)``: :func:`dilated_attention` of one group of rows, whose first key
    slot is at position ``offsets[b]``, over the keys from slot ``drop`` on (those before
    it no query attends to). ``keys_finite``: the caller knows that ``k, v`` hold no NaN
    or infinity (a :class:`DilatedCache` window), so the library does not scan them
    again: a decode step then goes straight to the lean path
    (:func:`dilated_attention.ops.decode.attend_step`)."""
    # padding that matters: a padded key at or after slot drop
    padding = None if mask is None or bool(mask[:, drop:].all()) else ~mask
    if keys_finite and not options["dropout_p"]:
        # The options were checked by register(), the keys' reach and the mask by the caller.
        validation.refuse_torch_func(q, k, v)
        validation.check_qkv(q, k, v, "bhnd")
        scale = validation.check_scale(options["softmax_scale"], q.shape[-1])
        call = validation.Attention(
            q=q.transpose(1, 2),
            k=k[:, :, drop:].transpose(1, 2),
            v=v[:, :, drop:].transpose(1, 2),
            padding=None if padding is None else padding[:, drop:],
            segment_lengths=options["segment_lengths"],
            dilation_rates=options["dilation_rates"],
            mode=options["mode"],
            head_offsets=options["head_offsets"],
            is_causal=True,
            scale=scale,
            key_offsets=tuple(offset + drop for offset in offsets),
        )
        out, lse = functional.run(call, keys_checked=True)  # a decode step takes the lean path there
        out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    else:
        out, lse = dilated_attention(
            q,
            k[:, :, drop:],
            v[:, :, drop:],
            key_padding_mask=None if padding is None else padding[:, drop:],
            key_offset=offsets[0] + drop if len(set(offsets)) == 1 else torch.tensor(offsets) + drop,
            return_lse=True,
            **options,
        )
    return out if sinks is None else _with_sinks(out, lse, sinks)


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``out`` ``(B, H, L, D)`` with one more logit per head, ``sinks`` ``(H,)``, in each
    query's softmax (its value vector zero): ``out * sigmoid(lse - sink)``, with ``lse``
    ``(B, H, L)`` the log of the softmax denominator (``-inf``, a query that attends to
    nothing, stays 0). Computed in the LSE's dtype (float32 or float64)."""
    keep = torch.sigmoid(lse - sinks.to(lse.dtype).view(-1, 1))
    return (out * keep.unsqueeze(-1)).to(out.dtype)
