"""The functional API: ``dilated_attention``."""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch

from . import validation
from .dropout import draw_seed
from .engine import DilatedAttentionFunction, EngineConfig, contiguous_last_dim
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
    layout: str = "bnhd",
    process_group=None,
):
    """LongNet dilated attention, computed exactly as ``docs/definition.md`` defines it.

    Args:
        q, k, v: ``(B, N, H, D)`` = (batch, seq_len, heads, head_dim), or with
            ``layout="bhnd"`` ``(B, H, N, D)`` (PyTorch SDPA's layout); one shape,
            dtype and device, any strides. Any ``N >= 1``.
        segment_lengths: ``w_i >= 1`` per branch (``w > N`` means one segment).
        dilation_rates: ``r_i >= 1`` per branch, as many as ``segment_lengths``.
        mode: ``"mixture"`` (every branch on every head, head ``j`` with offset
            ``j % r_i``, results mixed by their softmax denominators) or
            ``"head_groups"`` (branch ``i`` on head group ``i`` only, output divided
            by the number of branches; needs ``H >= len(segment_lengths)``).
        is_causal: a query attends only to keys at positions ``<=`` its own.
        softmax_scale: factor on ``q @ k^T``, any finite float; default ``D ** -0.5``.
        dropout_p: dropout on the attention probabilities, applied whenever it is
            ``> 0`` (the modules pass 0 in eval mode). Whether a probability is kept
            depends only on a seed drawn from PyTorch's generator of the inputs'
            device and on its (batch row, head, query, key) position. Uses the
            unfused math kernel.
        key_padding_mask: optional bool ``(B, N)``, ``True`` marks a padded key;
            padded keys have no effect at all, whatever their rows hold.
        return_lse: also return the log-sum-exp.
        layout: ``"bnhd"`` (default) or ``"bhnd"``: the layout of ``q, k, v``, of
            the output and of the LSE (``(B, N, H)`` or ``(B, H, N)``).
        process_group: a ``torch.distributed`` process group (``None``: one process).
            Then ``q, k, v`` (and the mask) are this rank's contiguous shard of the
            sequence, rank ``k`` holding the ``k``-th; shards may differ in length
            (the lengths are exchanged on every call, with a check that all ranks
            use the same configuration). The output and LSE are the same shard of
            the single-process result, and so are the gradients.

    Returns:
        ``out`` (the layout of ``q``) in the dtype of ``q``; with ``return_lse``,
        ``(out, lse)`` where ``lse`` is float32 (float64 for float64 input), the
        natural log of the softmax denominator with the scale applied, ``-inf``
        where a (position, head) attends to nothing (its output is 0). Both are
        differentiable, exactly, including through the mixing weights of
        ``mixture``; double backward is refused.

    NaN in a query, or in a key a query attends to, gives NaN in that query's
    output and LSE.
    """

    def validate():
        call = validation.check_attention(
            q, k, v, segment_lengths, dilation_rates, mode, is_causal, softmax_scale, key_padding_mask, layout
        )
        return call, validation.check_dropout(dropout_p), validation.check_flag(return_lse, "return_lse")

    if process_group is None:
        call, dropout, want_lse = validate()
        seed = draw_seed(call.q.device) if dropout > 0 else None
        blocks = make_plan(call.shape[1], call.shape[2], call.segment_lengths, call.dilation_rates, call.mode)
        sharding, first_position = None, 0
    else:
        from .distributed import make_sharding

        try:
            call, dropout, want_lse = validate()
            error = None
        except (ValueError, TypeError) as exc:
            call = dropout = want_lse = None
            error = exc
        sharding = make_sharding(process_group, call, dropout, error)
        seed, blocks, first_position = sharding.seed, sharding.plan.blocks, sharding.plan.first_position
    _, _, num_heads, _ = call.shape
    if torch.jit.is_tracing():
        warnings.warn(
            f"torch.jit.trace records dilated_attention for q, k, v of shape {call.shape} (B, N, H, D) "
            "only: the traced graph computes wrong numbers for other sequence lengths or head "
            "counts. Trace once per shape, or use torch.compile, which follows shape changes.",
            stacklevel=2,
        )
    cfg = EngineConfig(
        blocks=tuple(blocks),
        unwritten_heads=tuple(partly_covered_heads(num_heads, call.dilation_rates, call.mode)),
        max_call_elements=MAX_CALL_ELEMENTS.get(call.q.device.type, MAX_CALL_ELEMENTS["default"]),
        is_causal=call.is_causal,
        scale=validation.kernel_scale(call.scale, call.q.dtype),
        dropout_p=dropout,
        out_scale=1.0 if call.mode == "mixture" else 1.0 / len(call.segment_lengths),
        kernel=select_kernel(call.q.device, call.q.dtype, dropout),
        first_position=first_position,
    )
    q_, k_, v_ = (contiguous_last_dim(t) for t in (call.q, call.k, call.v))
    out, lse = DilatedAttentionFunction.apply(q_, k_, v_, call.padding, seed, cfg, sharding)
    if layout == "bhnd":
        out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    return (out, lse) if want_lse else out
