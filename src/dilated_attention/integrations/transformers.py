"""Dilated attention inside Hugging Face ``transformers`` models, through their attention interface.

    from dilated_attention.integrations.transformers import register
    register("dilated", segment_lengths=[2048, 4096, 8192], dilation_rates=[1, 2, 4])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="dilated")

Every layer then runs causal dilated attention on its ``q, k, v``. Needs the ``hf``
extra (``transformers``); ``import dilated_attention`` never imports it.

What the function does with what ``transformers`` passes:

- ``(B, H, L, D)`` inputs go in as they are (``layout="bhnd"``); the output is
  ``(B, L, H, D)``, as the interface expects.
- Grouped-query attention (``module.num_key_value_groups > 1``): each key/value head is
  repeated for its query heads (a copy of the keys; the engine does not share key
  heads yet).
- ``scaling`` is the softmax scale, ``dropout`` the attention dropout (``transformers``
  passes 0 in eval mode).
- Causal only: a module with ``is_causal=False`` (an encoder, cross-attention) is
  refused.
- The attention mask is the 2-D padding mask (``True`` = token), as ``transformers``
  builds it for this registration. Segments follow each sequence's own positions: a
  left-padded row's first real token is position 0 (as the ``position_ids`` that
  ``generate`` makes say), its padding attends to nothing and outputs 0. Padding at
  the end of a row (right padding, unfilled cache slots) is masked out. A mask with
  padding between tokens, or ``position_ids`` that disagree (packed sequences), is
  refused.
- ``output_attentions``, ``softcap``, ``sliding_window`` and 4-D masks are refused with
  a ``ValueError``: dilated attention forms no weight matrix and has its own sparsity.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from .. import validation
from ..functional import dilated_attention


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
    options = dict(segment_lengths=segs, dilation_rates=rates, mode=validation.check_mode(mode),
                   head_offsets=validation.check_head_offsets(head_offsets))
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as exc:
        raise ImportError("the transformers integration needs transformers >= 4.57: "
                          "pip install 'dilated-attention[hf]'") from exc
    AttentionInterface.register(name, functools.partial(dilated_attention_forward, **options))
    # The mask transformers builds for flash attention: None without padding, else the
    # 2-D padding mask (True = token) over the keys.
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def dilated_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    *,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    mode: str,
    head_offsets: str,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``transformers`` attention function: ``query`` ``(B, H, Lq, D)``, ``key,
    value`` ``(B, H_kv, Lk, D)`` (the queries are the last ``Lq`` of the ``Lk``
    positions) -> ``((B, Lq, H, D), None)``."""
    _refuse_unsupported(module, attention_mask, is_causal, kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    options = dict(segment_lengths=segment_lengths, dilation_rates=dilation_rates, mode=mode,
                   head_offsets=head_offsets, is_causal=True, softmax_scale=scaling, dropout_p=dropout,
                   layout="bhnd")
    if attention_mask is None:
        _check_positions_are_indices(kwargs.get("position_ids"), key.shape[2], query.shape[2])
        out = dilated_attention(query, key, value, **options)
    else:
        out = _padded_rows(query, key, value, attention_mask.bool(), kwargs.get("position_ids"), options)
    return out.transpose(1, 2), None


def _refuse_unsupported(module, attention_mask, is_causal, kwargs) -> None:
    if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        raise ValueError(f"dilated attention is registered for causal self-attention only; "
                         f"{type(module).__name__} is not causal (an encoder or cross-attention): use another "
                         "attn_implementation for it")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True is not supported: dilated attention never forms the weights")
    for option in ("softcap", "sliding_window"):
        if kwargs.get(option) is not None:
            raise ValueError(f"the model sets {option}={kwargs[option]!r}, which dilated attention does not "
                             f"implement: use a config without {option}")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"dilated attention takes the 2-D padding mask, got a {attention_mask.dim()}-D attention "
                         "mask: register the function with register(), which sets the mask transformers builds")


def _check_positions_are_indices(position_ids, num_keys: int, num_queries: int) -> None:
    """Without padding, the queries' ``position_ids`` must be their indices among the keys."""
    if position_ids is None:
        return
    indices = torch.arange(num_keys - num_queries, num_keys, device=position_ids.device)
    if position_ids.shape[-1] != num_queries or not bool((position_ids == indices).all()):
        raise ValueError(
            "position_ids must be the tokens' places in their sequence (0, 1, 2, ... over the keys); packed "
            "sequences and other positions are not supported"
        )


def _padded_rows(query, key, value, mask, position_ids, options) -> torch.Tensor:
    """Attention of rows with padding at their start and end. A row whose first token
    is at position 0 (``position_ids`` as ``generate`` makes them) attends as the
    sequence that starts after its ``p`` padding keys (one call per distinct ``p``); a
    row whose positions are its indices (no ``position_ids``, or ``0 ..`` across the
    padding) keeps its keys in place, the padding masked."""
    batch, _, num_queries, _ = query.shape
    num_keys = key.shape[2]
    if mask.shape != (batch, num_keys):
        raise ValueError(
            f"the padding mask has shape {tuple(mask.shape)}, expected (batch, keys) = {(batch, num_keys)}"
        )
    tokens = mask.sum(1)
    left = mask.int().argmax(1).where(tokens > 0, torch.full_like(tokens, num_keys))  # leading padding per row
    steps = torch.arange(num_keys, device=mask.device)
    if not torch.equal(mask, (steps >= left[:, None]) & (steps < (left + tokens)[:, None])):
        raise ValueError("dilated attention takes padding only at the start or the end of a row, not between tokens")
    shift = _position_shift(position_ids, mask, left, num_keys - num_queries)
    groups = sorted(set(shift.tolist()))
    out = None if groups == [0] else query.new_zeros(query.shape)
    for skip in groups:  # rows that attend from key `skip` on (0: all their keys, padding masked)
        rows = None if out is None else (shift == skip).nonzero().flatten()
        q, k, v, m = (t if rows is None else t[rows] for t in (query, key, value, mask))
        real_queries = min(num_queries, num_keys - skip)
        q, k, v, padding = q[:, :, num_queries - real_queries :], k[:, :, skip:], v[:, :, skip:], ~m[:, skip:]
        result = dilated_attention(q, k, v, key_padding_mask=padding if bool(padding.any()) else None, **options)
        if out is None:
            return result
        out[rows, :, num_queries - real_queries :] = result
    return out


def _position_shift(position_ids, mask, left, first_query) -> torch.Tensor:
    """Per row, 0 if its tokens sit at their indices, ``left`` if its first token is at
    position 0; anything else is refused."""
    if position_ids is None:
        return torch.zeros_like(left)
    batch, num_queries = mask.shape[0], position_ids.shape[-1]
    index = first_query + torch.arange(num_queries, device=mask.device).expand(batch, -1)
    real = mask.gather(1, index)
    offset = index - position_ids.to(mask.device).expand(batch, -1)  # index - position, on real queries
    in_place = ((offset == 0) | ~real).all(1)
    counted = ((offset == left[:, None]) | ~real).all(1)
    if not bool((in_place | counted).all()):
        row = int((~(in_place | counted)).nonzero()[0])
        raise ValueError(
            "position_ids must number each row's tokens consecutively from 0, either from its first token "
            "(as generate does after left padding) or from its first slot; packed sequences and other "
            f"positions are not supported (row {row}: token index minus position = "
            f"{sorted(set(offset[row][real[row]].tolist()))})"
        )
    return torch.where(in_place, torch.zeros_like(left), left)
