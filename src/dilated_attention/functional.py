"""The functional API: ``dilated_attention``."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import validation
from .engine import DilatedAttentionFunction, EngineConfig
from .kernels import select_kernel
from .plan import make_plan, partly_covered_heads

# Largest output of one kernel call, in elements. On CPU 2**22 (16 MiB in float32):
# large enough that per-call overhead is negligible, small enough that glibc serves
# it from reused memory instead of mapping and faulting in fresh pages each call.
# Elsewhere the caching allocator reuses memory and larger calls keep a GPU busy.
MAX_CALL_ELEMENTS = {"cpu": 2**22, "default": 2**28}


def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    mode: str = "mixture",
    is_causal: bool = False,
    softmax_scale: Optional[float] = None,
    dropout_p: float = 0.0,
    key_padding_mask: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    process_group=None,
):
    """LongNet dilated attention, computed exactly as ``SPEC.md`` defines it.

    Args:
        q, k, v: ``(B, N, H, D)``, one shape, dtype and device. Any ``N >= 1``.
        segment_lengths: ``w_i >= 1`` per branch (``w > N`` means one segment).
        dilation_rates: ``r_i >= 1`` per branch, as many as ``segment_lengths``.
        mode: ``"mixture"`` (every branch on every head, head ``j`` with offset
            ``j % r_i``, results mixed by their softmax denominators) or
            ``"head_groups"`` (branch ``i`` on head group ``i`` only, output divided
            by the number of branches; needs ``H >= len(segment_lengths)``).
        is_causal: a query attends only to keys at positions ``<=`` its own.
        softmax_scale: factor on ``q @ k^T``; default ``D ** -0.5``.
        dropout_p: dropout on the attention probabilities, applied whenever it is
            ``> 0`` (the modules pass 0 in eval mode). Uses the unfused math kernel.
        key_padding_mask: optional bool ``(B, N)``, ``True`` marks a padded key.
        return_lse: also return the log-sum-exp.
        process_group: a ``torch.distributed`` process group (``None``: one process).
            Then ``q, k, v`` (and the mask) are this rank's contiguous shard of the
            sequence, rank ``k`` holding the ``k``-th; shards may differ in length
            (the lengths are exchanged on every call, with a check that all ranks
            use the same configuration). The output and LSE are the same shard of
            the single-process result, and so are the gradients.

    Returns:
        ``out`` ``(B, N, H, D)`` in the dtype of ``q``; with ``return_lse``,
        ``(out, lse)`` where ``lse`` ``(B, N, H)`` is float32 (float64 for float64
        input), the natural log of the softmax denominator with the scale applied,
        ``-inf`` where a (position, head) attends to nothing (its output is 0).
        ``lse`` is not differentiable. Gradients of ``out`` are exact, including
        through the mixing weights of ``mixture``.
    """
    validation.check_qkv(q, k, v)
    segment_lengths, dilation_rates = validation.check_branches(segment_lengths, dilation_rates)
    mode = validation.check_mode(mode)
    is_causal = validation.check_flag(is_causal, "is_causal")
    return_lse = validation.check_flag(return_lse, "return_lse")
    dropout_p = validation.check_dropout(dropout_p)
    batch, seq_len, num_heads, head_dim = q.shape
    scale = validation.check_scale(softmax_scale, head_dim)
    padding = validation.check_padding_mask(key_padding_mask, batch, seq_len, q.device)
    num_branches = len(segment_lengths)
    if mode == "head_groups":
        validation.check_head_groups(num_heads, num_branches)
    sharding = None
    if process_group is not None:
        from .distributed import make_sharding

        sharding = make_sharding(
            process_group, q, segment_lengths, dilation_rates, mode, is_causal, padding is not None, scale, dropout_p
        )
        blocks = sharding.plan.blocks
    else:
        blocks = make_plan(seq_len, num_heads, segment_lengths, dilation_rates, mode)
    cfg = EngineConfig(
        blocks=tuple(blocks),
        unwritten_heads=tuple(partly_covered_heads(num_heads, dilation_rates, mode)),
        max_call_elements=MAX_CALL_ELEMENTS.get(q.device.type, MAX_CALL_ELEMENTS["default"]),
        is_causal=is_causal,
        scale=scale,
        dropout_p=dropout_p,
        out_scale=1.0 if mode == "mixture" else 1.0 / num_branches,
        kernel=select_kernel(q.device, q.dtype, dropout_p),
    )
    out, lse = DilatedAttentionFunction.apply(q, k, v, padding, cfg, sharding)
    return (out, lse) if return_lse else out
