"""Dense reference implementation of ``docs/definition.md``: slow, float64, obviously right.

It builds each branch's full ``(Lq, Lk)`` boolean pattern per head, runs a plain
masked softmax, and mixes the branches with the formulas of the definition. Use it to
check the fast implementation, or your own setup, on small inputs: memory is
``O(B * H * N^2)``. It is differentiable with autograd (no dropout).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .ops.plan import head_group_bounds
from .ops.validation import check_attention, check_branches, check_head_groups, check_head_offsets, check_mode


def branch_pattern(
    seq_len: int,
    w: int,
    r: int,
    offsets: torch.Tensor,
    is_causal: bool = False,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool ``(H, N, N)``: ``[h, p, key]`` is True when query ``p`` of head ``h`` (with
    dilation offset ``offsets[h]``) may attend to ``key`` in branch ``(w, r)``.

    A position is *selected* when its relative position ``t = p - s*w`` in its
    segment ``s = p // w`` has ``t % r == offset``; selected queries see the
    selected keys of their own segment (and, if causal, only keys ``<= p``).
    ``w > N`` is the same as ``w = N``, and ``t % r = t % min(r, w)`` for ``t < w``:
    both are clamped so that any Python int works. ``query_positions`` and
    ``key_positions`` (``(..., Lq)``, ``(..., Lk)``, positions below ``seq_len``;
    default all) give the pattern ``(..., H, Lq, Lk)`` of those positions only.
    """
    w = min(w, seq_len)
    r = min(r, w)
    queries = torch.arange(seq_len) if query_positions is None else query_positions
    keys = torch.arange(seq_len) if key_positions is None else key_positions

    def selected(positions):  # (..., H, L)
        return (positions % w % r).unsqueeze(-2) == offsets[:, None]

    same_segment = (queries // w).unsqueeze(-1) == (keys // w).unsqueeze(-2)  # (..., Lq, Lk)
    pattern = selected(queries).unsqueeze(-1) & selected(keys).unsqueeze(-2) & same_segment.unsqueeze(-3)
    if is_causal:
        pattern = pattern & (keys.unsqueeze(-2) <= queries.unsqueeze(-1)).unsqueeze(-3)
    return pattern


def branch_offsets(
    num_heads: int, segment_lengths, dilation_rates, mode: str, head_offsets: str = "interleaved"
) -> list[torch.Tensor]:
    """Per branch, the offset of each head, or ``-1`` where the branch does not run on
    it: in ``mixture`` ``j % r`` (``interleaved``) or ``j // ceil(H / r)``
    (``contiguous``); in ``head_groups`` ``i % r_i`` on group ``i``."""
    result: list[torch.Tensor] = []
    if mode == "mixture":
        for r in dilation_rates:
            run = -(-num_heads // r)
            result.append(
                torch.tensor([j % r if head_offsets == "interleaved" else j // run for j in range(num_heads)])
            )
    else:
        for i, ((start, stop), r) in enumerate(
            zip(head_group_bounds(num_heads, len(segment_lengths)), dilation_rates, strict=True)
        ):
            offsets = torch.full((num_heads,), -1)
            offsets[start:stop] = i % r
            result.append(offsets)
    return result


def _masked_softmax_attention(q, k, v, allowed, scale):
    """``O`` ``(B, H, N, D)`` and ``LSE`` ``(B, H, N)`` over the keys in ``allowed``
    ``(B, H, N, N)``; rows with no allowed key give ``O = 0``, ``LSE = -inf``."""
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    scores = scores.masked_fill(~allowed, -math.inf)
    row_max = scores.amax(-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    denom = weights.sum(-1, keepdim=True)
    has_key = denom > 0
    safe_denom = torch.where(has_key, denom, torch.ones_like(denom))
    out = torch.einsum("bhqk,bhkd->bhqd", weights / safe_denom, v)
    lse = torch.where(has_key, torch.log(safe_denom) + row_max, torch.full_like(denom, -math.inf))
    return out, lse.squeeze(-1)


def _mix(outs, lses):
    """The definition's mixture: ``LSE = logsumexp_i LSE_i``, ``O = sum_i exp(LSE_i - LSE) O_i``."""
    lses = torch.stack(lses)  # (G, B, H, N)
    top = lses.amax(0).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lses - top)
    denom = weights.sum(0)
    has_any = denom > 0
    safe = torch.where(has_any, denom, torch.ones_like(denom))
    out = sum(w.unsqueeze(-1) * o for w, o in zip(weights / safe, outs, strict=True))
    lse = torch.where(has_any, torch.log(safe) + top, torch.full_like(denom, -math.inf))
    return out, lse


def reference_dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    mode: str = "mixture",
    head_offsets: str = "interleaved",
    is_causal: bool = False,
    softmax_scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    key_offset=0,
):
    """Dense float64 dilated attention. Same arguments as
    :func:`dilated_attention.dilated_attention` (no dropout, ``(B, L, H, D)`` only),
    validated the same way: ``q`` ``(B, Lq, H, D)`` holds the last ``Lq`` of the
    positions ``key_offset .. key_offset + Lk - 1`` of ``k, v`` ``(B, Lk, H, D)``.

    Returns ``(out, lse)``: ``out`` ``(B, Lq, H, D)`` float64 and ``lse`` ``(B, Lq, H)``
    float64, computed in float64 whatever the input dtype.

    Non-finite inputs follow ``docs/definition.md``: padded keys have no effect
    whatever they hold; a NaN or infinity in a query row, or in the key or value row
    of an unpadded key the query attends to, makes that query's output and LSE NaN
    (if it attends to anything); other rows are computed as if those rows were 0,
    and the NaN rows pass no gradient back.
    """
    call = check_attention(
        q,
        k,
        v,
        segment_lengths,
        dilation_rates,
        mode,
        is_causal,
        softmax_scale,
        key_padding_mask,
        head_offsets=head_offsets,
        key_offset=key_offset,
    )
    offsets = branch_offsets(call.shape[2], call.segment_lengths, call.dilation_rates, call.mode, call.head_offsets)
    return _dense_dilated_attention(
        call.q,
        call.k,
        call.v,
        call.segment_lengths,
        call.dilation_rates,
        offsets,
        call.mode,
        call.is_causal,
        call.scale,
        call.padding,
        call.key_offsets,
    )


def _dense_dilated_attention(
    q, k, v, segment_lengths, dilation_rates, offsets, mode, is_causal, scale, padding, key_offsets
):
    """:func:`reference_dilated_attention` on valid arguments, with each branch's head
    ``offsets``; ``v`` may have its own last dim."""
    q, k, v = (t.to(torch.float64).transpose(1, 2) for t in (q, k, v))  # (B, H, L, D)
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))  # grouped-query heads
    batch, _, num_queries, _ = q.shape
    num_keys = k.shape[2]
    key_positions = torch.tensor(key_offsets)[:, None] + torch.arange(num_keys)  # (B, Lk)
    query_positions = key_positions[:, num_keys - num_queries :]
    seq_len = max(key_offsets) + num_keys
    key_ok = torch.ones(batch, num_keys, dtype=torch.bool, device=q.device)
    if padding is not None:
        key_ok = ~padding
    bad_q = ~torch.isfinite(q).all(-1)  # (B, H, Lq)
    bad_key = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1)) & key_ok[:, None, :]
    cleared = (bad_key | ~key_ok[:, None, :]).unsqueeze(-1)
    k, v = k.masked_fill(cleared, 0.0), v.masked_fill(cleared, 0.0)
    outs, lses = [], []
    reached = torch.zeros_like(bad_q)
    for w, r, offs in zip(segment_lengths, dilation_rates, offsets, strict=True):
        pattern = branch_pattern(seq_len, w, r, offs, is_causal, query_positions, key_positions)  # (B, H, Lq, Lk)
        allowed = pattern.to(q.device) & key_ok[:, None, None, :]
        out, lse = _masked_softmax_attention(q.masked_fill(bad_q.unsqueeze(-1), 0.0), k, v, allowed, scale)
        outs.append(out)
        lses.append(lse)
        reached |= (allowed & bad_key[:, :, None, :]).any(-1) | (bad_q & allowed.any(-1))
    if mode == "mixture":
        out, lse = _mix(outs, lses)
    else:  # head groups never overlap: each head has one branch's result
        out = sum(outs) / len(segment_lengths)
        lse = torch.stack(lses).amax(0)
    out, lse = out.masked_fill(reached.unsqueeze(-1), math.nan), lse.masked_fill(reached, math.nan)
    return out.transpose(1, 2), lse.transpose(1, 2)


def attention_weights_uniform(
    seq_len: int,
    num_heads: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    mode: str = "mixture",
    head_offsets: str = "interleaved",
    is_causal: bool = False,
) -> torch.Tensor:
    """``(H, N, N)`` float64: the attention weight each key gets when every score is
    equal. In ``mixture`` a key seen by two branches counts twice, so a row shows
    how the branches share the softmax; in ``head_groups`` each row is its group's
    branch alone (scaled by ``1 / G``). Rows that attend to nothing are 0.
    ``head_offsets``: as in :func:`dilated_attention.dilated_attention`.
    """
    segment_lengths, dilation_rates = check_branches(segment_lengths, dilation_rates)
    check_head_offsets(head_offsets)
    if check_mode(mode) == "head_groups":
        check_head_groups(num_heads, len(segment_lengths))
    zeros = torch.zeros(1, seq_len, num_heads, 1, dtype=torch.float64)
    values = torch.eye(seq_len, dtype=torch.float64)[None, :, None, :].expand(1, seq_len, num_heads, seq_len)
    offsets = branch_offsets(num_heads, segment_lengths, dilation_rates, mode, head_offsets)
    out, _ = _dense_dilated_attention(
        zeros, zeros, values, segment_lengths, dilation_rates, offsets, mode, is_causal, 1.0, None, (0,)
    )
    return out[0].transpose(0, 1)  # (H, N, N): row p = weights of query p over keys
