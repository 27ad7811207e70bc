"""The functional API: ``dilated_attention``."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from .ops import decode, fused, validation
from .ops.dropout import draw_seed
from .ops.engine import DilatedAttentionFunction, EngineConfig
from .ops.finite import nonfinite_rows
from .ops.kernels import select_kernel
from .ops.plan import Block, FusedPlan, branch_table, leaves_cells_unwritten, make_plan, output_scale
from .ops.strides import contiguous_last_dim

# Largest output of one kernel call, in elements. On CPU 2**20 (4 MiB in float32):
# large enough that per-call overhead is negligible, small enough that glibc serves a
# call's temporaries (its output and packed inputs) from reused memory instead of
# mapping and faulting in fresh pages each call (benchmarks/cpu_costs.py times a
# forward and backward at 2**20 against 2**22).
# Elsewhere the caching allocator reuses memory and larger calls keep a GPU busy.
MAX_CALL_ELEMENTS = {"cpu": 2**20, "default": 2**28}


def dilated_attention(
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
    dropout_p: float = 0.0,
    key_padding_mask: torch.Tensor | None = None,
    key_offset: int | torch.Tensor = 0,
    return_lse: bool = False,
    layout: str = "bnhd",
    process_group=None,
    kernel: str | None = None,
):
    """LongNet dilated attention, computed exactly as ``docs/definition.md`` defines it.

    Args:
        q: ``(B, Lq, H, D)`` = (batch, seq_len, heads, head_dim), or with
            ``layout="bhnd"`` ``(B, H, Lq, D)`` (PyTorch SDPA's layout); any strides.
        k, v: ``(B, Lk, H_kv, D)`` (or ``(B, H_kv, Lk, D)``), ``Lk >= Lq``; the same
            dtype and device as ``q``. ``H_kv = H``, or fewer heads that divide ``H``
            (grouped-query attention): query head ``j`` then uses key/value head
            ``j // (H / H_kv)``, and the keys are shared, not repeated. Usually
            ``Lq = Lk``: self-attention over one sequence. With ``is_causal``, ``q``
            may hold only the *last* ``Lq`` of the keys' positions (a prefill
            chunk, a decode step).
        segment_lengths: ``w_i >= 1`` per branch (``w > N`` means one segment).
        dilation_rates: ``r_i >= 1`` per branch, as many as ``segment_lengths``.
        mode: ``"mixture"`` (every branch on every head, results mixed by their
            softmax denominators) or ``"head_groups"`` (branch ``i`` on head group
            ``i`` only, output divided by the number of branches; needs
            ``H >= len(segment_lengths)``).
        head_offsets: in ``mixture``, which offset head ``j`` uses in a branch of
            rate ``r``: ``"interleaved"`` (``j % r``, the paper) or ``"contiguous"``
            (``j // ceil(H / r)``, torchscale's LongNet and LongViT).
        is_causal: a query attends only to keys at positions ``<=`` its own.
        softmax_scale: factor on ``q @ k^T``, any finite float; default ``D ** -0.5``.
        dropout_p: dropout on the attention probabilities, applied whenever it is
            ``> 0`` (the modules pass 0 in eval mode). Whether a probability is kept
            depends only on a seed drawn from PyTorch's generator of the inputs'
            device and on its (batch row, head, query, key) position. Uses the
            unfused math kernel.
        key_padding_mask: optional bool ``(B, Lk)``, ``True`` marks a padded key;
            padded keys have no effect at all, whatever their rows hold.
        key_offset: the sequence position of ``k``'s first row (an int, or a ``(B,)``
            integer tensor: one per sequence); the queries are positions
            ``key_offset + Lk - Lq ..``. Segments are anchored at position 0, and the
            keys must reach back to the start of the first query's segment in every
            branch (the ``max(segment_lengths) - 1`` positions before the first query
            always do). Under ``torch.compile(fullgraph=True)`` pass an int.
        return_lse: also return the log-sum-exp.
        layout: ``"bnhd"`` (default) or ``"bhnd"``: the layout of ``q, k, v``, of
            the output and of the LSE (``(B, Lq, H)`` or ``(B, H, Lq)``).
        process_group: a ``torch.distributed`` process group, or a
            :class:`dilated_attention.ops.distributed.Communicator` (``None``: one
            process). Then ``q, k, v`` (and the mask) are this rank's contiguous shard
            of the sequence, rank ``k`` holding the ``k``-th; shards may differ in
            length. The output and LSE are the same shard of the single-process
            result, and so are the gradients.
        kernel: ``"auto"`` (the fused Triton kernels on CUDA for float16/bfloat16,
            head dims 16..256, no dropout, one process; PyTorch's kernels
            otherwise), ``"triton"`` (the fused kernels or a ``ValueError`` saying why
            not) or ``"torch"``; default: ``$DILATED_ATTENTION_KERNEL``, else
            ``"auto"``. Every choice computes the same function (see
            :mod:`dilated_attention.ops.fused`).

    Returns:
        ``out`` (the layout of ``q``) in the dtype of ``q``; with ``return_lse``,
        ``(out, lse)`` where ``lse`` is float32 (float64 for float64 input), the
        natural log of the softmax denominator with the scale applied, ``-inf``
        where a (position, head) attends to nothing (its output is 0). Both are
        differentiable, exactly, including through the mixing weights of
        ``mixture``; double backward is refused.

    Under ``torch.autocast``, float32, float16 and bfloat16 ``q, k, v`` are cast to
    its dtype on their device first, as SDPA's are (float64 is not cast).

    NaN in a query, or in a key a query attends to, gives NaN in that query's
    output and LSE. Under a ``torch.func`` transform (``vmap``, ``grad``, ...) or with
    forward-mode tangents (``torch.autograd.forward_ad``) it
    raises ``RuntimeError`` before any work; ``torch.compile`` works (a call with a
    ``process_group`` runs eagerly inside the compiled code: a graph break).
    """

    validation.refuse_torch_func(q, k, v)
    q, k, v = validation.autocast_inputs(q, k, v)  # as SDPA: computed in autocast's dtype under it

    def validate():
        call = validation.check_attention(
            q,
            k,
            v,
            segment_lengths,
            dilation_rates,
            mode,
            is_causal,
            softmax_scale,
            key_padding_mask,
            layout,
            head_offsets,
            key_offset,
        )
        dropout = validation.check_dropout(dropout_p)
        fused.use_triton(call.q, dropout, process_group is not None, kernel)  # a bad kernel choice raises here
        return call, dropout, validation.check_flag(return_lse, "return_lse")

    if process_group is None:
        call, dropout, want_lse = validate()
        seed = draw_seed(call.q.device) if dropout > 0 else None
        _warn_if_traced(call)
        out, lse = run(call, dropout, seed, None, kernel=kernel)
    else:
        out, lse, want_lse = _across_processes(validate, process_group, kernel)
    if layout == "bhnd":
        out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    return (out, lse) if want_lse else out


@torch.compiler.disable  # dynamo traces neither process groups nor the exchange: this part runs eagerly
def _across_processes(validate, process_group, kernel):
    """``(out, lse, return_lse)`` of a call whose inputs are this rank's shard: checked
    on every rank together (:func:`dilated_attention.ops.distributed.make_exchange`),
    then run with the exchange of rows between ranks."""
    from .ops.distributed import make_exchange

    try:
        call, dropout, want_lse = validate()
        if call.k.shape[2] != call.shape[2]:
            raise ValueError(
                f"process_group takes as many key/value heads as query heads, got {call.k.shape[2]} and "
                f"{call.shape[2]}: repeat each key/value head for its query heads (grouped-query attention "
                "across processes is not supported)"
            )
        if call.num_keys != call.shape[1] or any(call.key_offsets):
            raise ValueError(
                "process_group takes shards of one whole sequence: q, k, v of one length and "
                "key_offset=0 (queries at the end of a key window are not split across processes)"
            )
        error = None
    except (ValueError, TypeError) as exc:
        call = dropout = want_lse = None
        error = exc
    exchange = make_exchange(process_group, call, dropout, error)
    _warn_if_traced(call)
    return (*run(call, dropout, exchange.seed, exchange, kernel=kernel), want_lse)


def _warn_if_traced(call) -> None:
    if torch.jit.is_tracing():
        warnings.warn(
            f"torch.jit.trace records dilated_attention for q of shape {call.shape} (B, Lq, H, D) and "
            f"{call.num_keys} keys only: the traced graph computes wrong numbers for other lengths or "
            "head counts. Trace once per shape, or use torch.compile, which follows shape changes.",
            stacklevel=3,
        )


def run(
    call,
    dropout: float = 0.0,
    seed=None,
    exchange=None,
    key_flags=None,
    keys_checked: bool = False,
    kernel: str | None = None,
):
    """A validated call (:class:`dilated_attention.ops.validation.Attention`) through the
    engine: ``(out, lse)``, ``(B, Lq, H, D)`` and ``(B, Lq, H)``.

    ``keys_checked``: the caller knows which key rows hold a NaN or an infinity:
    those flagged in ``key_flags`` (``(B, Lk, H)`` bool), none if it is ``None``; the
    engine then skips scanning ``k, v`` for them (a decode step's window).
    ``kernel``: see :mod:`dilated_attention.ops.fused`; the fused kernels take every batch
    row in one launch, whatever its key offset."""
    checks = (key_flags, keys_checked)
    if (
        call.is_causal
        and exchange is None
        and takes_step(call.q, call.k, call.v, call.shape[1], dropout, kernel)
        and (key_flags is None if keys_checked else nonfinite_rows(call.k, call.v) is None)
    ):
        branches = (call.segment_lengths, call.dilation_rates, call.mode, call.head_offsets)
        return step(
            call.q, call.k.transpose(1, 2), call.v.transpose(1, 2), call.key_offsets, call.padding, branches, call.scale
        )
    if fused.use_triton(call.q, dropout, exchange is not None, kernel):
        table = branch_table(call.shape[2], call.segment_lengths, call.dilation_rates, call.mode, call.head_offsets)
        plan = FusedPlan(table, call.key_offsets, call.is_causal)
        return _run_engine(call, call.key_offsets[0], None, dropout, seed, None, *checks, fused_plan=plan)
    groups = rows_by_value(call.key_offsets)
    if len(groups) == 1:
        return _run_engine(call, call.key_offsets[0], None, dropout, seed, exchange, *checks)
    parts = [_run_engine(call, offset, rows, dropout, seed, None, *checks) for offset, rows in groups]
    order = row_order(groups, call.q.device)
    return tuple(torch.cat(part).index_select(0, order) for part in zip(*parts, strict=True))


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_offsets, padding, branches, scale: float):
    """The lean decode step (:func:`dilated_attention.ops.decode.attend_step`) of a
    validated causal call that :func:`takes_step`: ``q`` ``(B, Lq, H, D)``, ``k, v``
    ``(B, H_kv, Lk, D)`` (key-head-major views), ``key_offsets`` the position of each
    row's first key, ``padding`` ``(B, Lk)`` or ``None``, ``branches`` ``(segment_lengths,
    dilation_rates, mode, head_offsets)``, ``scale`` the checked softmax scale ->
    ``(out, lse)``, ``(B, Lq, H, D)`` and ``(B, Lq, H)``."""
    segment_lengths, dilation_rates, mode, head_offsets = branches
    tables = decode.decode_tables(
        q.shape[2], tuple(segment_lengths), tuple(dilation_rates), mode, head_offsets, q.device
    )
    return decode.attend_step(q, k, v, key_offsets, tables, validation.kernel_scale(scale, q.dtype), padding)


def takes_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_queries: int, dropout: float = 0.0, kernel=None
) -> bool:
    """Whether a validated causal call of ``num_queries`` query rows on ``q, k, v`` (any
    layout) takes the lean path of decode steps, once its keys and values are known to
    be finite (:mod:`dilated_attention.ops.decode`): a few query rows on the CPU, no
    dropout, nothing to differentiate, no NaN or infinity in ``q``, PyTorch's kernels
    (``kernel``: see :mod:`dilated_attention.ops.fused`). The caller checks that the
    call runs on one process."""
    if q.device.type != "cpu" or dropout > 0 or not decode.is_step(num_queries, q, k, v):
        return False
    return not fused.use_triton(q, dropout, False, kernel) and nonfinite_rows(q) is None


def rows_by_value(values: Sequence[int]) -> list[tuple[int, tuple[int, ...]]]:
    """``(value, batch rows)`` for each distinct value of ``values`` (one per batch row:
    key offsets, cache positions), in order of first use."""
    rows: dict[int, list[int]] = {}
    for row, value in enumerate(values):
        rows.setdefault(value, []).append(row)
    return [(value, tuple(members)) for value, members in rows.items()]


def row_order(groups: list[tuple[int, tuple[int, ...]]], device) -> torch.Tensor:
    """The index that puts results computed group by group (:func:`rows_by_value`) and
    concatenated back in batch-row order."""
    return torch.cat([torch.as_tensor(rows, device=device) for _, rows in groups]).argsort()


def _run_engine(
    call,
    key_offset: int,
    rows,
    dropout: float,
    seed,
    exchange,
    key_flags,
    keys_checked: bool,
    fused_plan: FusedPlan | None = None,
):
    """The engine on the batch rows ``rows`` (all if ``None``) of a validated call,
    whose keys start at ``key_offset`` (with ``fused_plan``: through the fused
    kernels, each row's keys where the plan says)."""
    _batch, num_queries, num_heads, _ = call.shape
    blocks: tuple[Block, ...]
    if fused_plan is not None:
        blocks, query_position = (), key_offset + call.num_keys - num_queries
    elif exchange is not None:
        blocks, query_position = exchange.plan.blocks, exchange.plan.first_position
    else:
        blocks = make_plan(
            num_queries,
            num_heads,
            call.segment_lengths,
            call.dilation_rates,
            call.mode,
            call.is_causal,
            call.head_offsets,
            call.num_keys,
            key_offset,
        )
        query_position = key_offset + call.num_keys - num_queries
    cfg = EngineConfig(
        blocks=tuple(blocks),
        unwritten_cells=leaves_cells_unwritten(call.dilation_rates, call.mode),
        max_call_elements=MAX_CALL_ELEMENTS.get(call.q.device.type, MAX_CALL_ELEMENTS["default"]),
        scale=validation.kernel_scale(call.scale, call.q.dtype),
        dropout_p=dropout,
        out_scale=output_scale(call.mode, len(call.segment_lengths)),
        kernel=None if fused_plan is not None else select_kernel(call.q.device, call.q.dtype, dropout),
        query_position=query_position,
        key_position=query_position + num_queries - call.num_keys,
        batch_rows=rows,
        fused=fused_plan,
    )
    tensors = [call.q, call.k, call.v, call.padding, key_flags]
    if rows is not None:
        index = torch.as_tensor(rows, device=call.q.device)
        tensors = [None if t is None else t.index_select(0, index) for t in tensors]
    q, k, v = (contiguous_last_dim(t) for t in tensors[:3])
    # the rows holding a NaN or an infinity, found once for the forward and the backward
    query_flags, key_flags = nonfinite_rows(q), tensors[4] if keys_checked else nonfinite_rows(k, v)
    args = (q, k, v, tensors[3], seed, query_flags, key_flags, cfg, exchange)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return DilatedAttentionFunction.apply(*args)
    return DilatedAttentionFunction.forward(*args)  # nothing to differentiate: skip autograd's bookkeeping
