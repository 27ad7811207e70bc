"""Sequence parallelism over ``torch.distributed``: the exchanges between ranks.

Rank ``k`` of a process group holds the ``k``-th contiguous shard of ``q, k, v``.
:func:`dilated_attention.ops.plan.make_shard_plan` says which rows of its keys and
values each peer needs (only the selected rows of segments they share); this module
checks that all ranks agree on the configuration (:func:`agree`), and an
:class:`Exchange` packs those rows into one message per peer, sends them with
``batch_isend_irecv`` while the local blocks compute, hands the received rows to the
engine as key sources with their blocks, and in backward sends the gradients of
those rows back to their owners.

A :class:`Communicator` is the process group as the caller holds it: pass one as
``process_group`` and its ``traffic`` says what the last call moved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from .dropout import draw_seed
from .engine import KeySource
from .finite import nonfinite_rows
from .kernels import accumulator
from .plan import Block, Rows, ShardPlan, make_shard_plan
from .validation import type_name


@dataclass
class Traffic:
    """Bytes of attention data a rank sent and received in one call's forward and
    backward (configuration checks and shard lengths, a few integers per call, are
    not counted)."""

    forward_sent: int = 0
    forward_received: int = 0
    backward_sent: int = 0
    backward_received: int = 0


class Communicator:
    """A process group for sequence-parallel dilated attention. Pass it as
    ``process_group`` (a plain group works too); after a call, ``traffic`` is the
    :class:`Traffic` of the latest call's forward, and of its backward once that has
    run (each call keeps its own record: the backward of an earlier call, say an
    earlier layer, adds to that call's, which the caller may have kept)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        if group is not None:
            _check_group(group, "Communicator takes a torch.distributed process group or None (the default group)")
        self._group = group
        self.traffic = Traffic()

    @property
    def group(self) -> dist.ProcessGroup:
        """The group given, else the default group, looked up when used: a communicator
        made before ``init_process_group`` uses the group it makes."""
        group = dist.group.WORLD if self._group is None else self._group
        if group is None:
            raise ValueError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
        return group

    def transfer(self, outgoing: dict[int, torch.Tensor], incoming: dict[int, torch.Tensor]):
        """Post one message to and from each peer (ranks of the group); the works to wait on."""
        ops = [dist.P2POp(dist.isend, buf, self._global(peer), self.group) for peer, buf in outgoing.items()]
        ops += [dist.P2POp(dist.irecv, buf, self._global(peer), self.group) for peer, buf in incoming.items()]
        return dist.batch_isend_irecv(ops) if ops else []

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer)


def communicator_of(process_group) -> Communicator:
    """``process_group`` (a group or a :class:`Communicator`) as a communicator, after
    checking that this process can take part: ``torch.distributed`` initialised, a
    group of the right type, of which this process is a member."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "process_group was given but torch.distributed is not initialized: call "
            "torch.distributed.init_process_group first, or pass process_group=None for one process"
        )
    if isinstance(process_group, Communicator):
        communicator = process_group
    else:
        communicator = Communicator(
            _check_group(
                process_group,
                "process_group must be a torch.distributed process group or a dilated_attention Communicator",
            )
        )
    if dist.get_rank(communicator.group) < 0:
        raise ValueError(_NOT_A_MEMBER.format(rank=dist.get_rank()))
    return communicator


def _check_group(group: object, expected: str) -> dist.ProcessGroup:
    """``group`` itself where it is a process group; else a ``TypeError`` saying
    ``expected``, or a ``ValueError`` for what ``new_group`` returns to processes
    outside the group."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(_NOT_A_MEMBER.format(rank=dist.get_rank()))
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{expected} (dist.group.WORLD, dist.new_group(...)), got {type_name(group)}")
    return group


_NOT_A_MEMBER = (
    "this process (global rank {rank}) is not a member of process_group: pass a group it belongs to "
    "(the ranks of a group call together, each with its own shard), or process_group=None for one process"
)


# What each collective of a call is, by the words its mismatch error uses: every
# rank's entry names its own, so that ranks at different steps (one passing
# ``positions``, another not) raise together instead of pairing unlike calls.
_STEPS = {
    "agree": "the attention's configuration check",
    "shard_start": "the shard's positions (LongNetLM, or a rotary layer given no positions)",
}


def _gather(group, entry: dict, error: Exception | None = None, step: str | None = None) -> list[dict]:
    """All-gather every rank's ``entry`` at collective ``step`` (a key of ``_STEPS``);
    where any rank's holds an ``"error"`` (its input was bad), every rank raises that
    error (the first such rank's message); where ranks are at different steps, every
    rank raises a ``ValueError`` saying which."""
    table: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(table, {**entry, "step": step}, group=group)
    for rank, theirs in enumerate(table):
        if "error" in theirs:
            kind, message = theirs["error"]
            raised = (TypeError if kind == "TypeError" else ValueError)(
                f"{message} (bad input on rank {rank} of process_group; every rank raises this error)"
            )
            raise raised from error
    steps = [theirs["step"] for theirs in table]
    if any(theirs != steps[0] for theirs in steps):
        raise ValueError(
            "process_group ranks made different calls (per rank: "
            f"{[_STEPS.get(theirs, theirs) for theirs in steps]}): every rank must call the layer or model "
            "with the same configuration, for instance positions= on every rank or on none"
        )
    return table


def raise_everywhere(process_group, error: Exception) -> NoReturn:
    """Raise ``error`` (a ``ValueError`` or ``TypeError`` of this rank's input) on every
    rank of ``process_group``: where a layer's own checks fail before its collective
    calls, this takes their place, so that the other ranks raise it in their first
    collective (:func:`agree`, :func:`shard_start`) instead of waiting for this one."""
    _gather(communicator_of(process_group).group, {"error": (type(error).__name__, str(error))}, error)
    raise error  # not reached: the table holds this rank's error, which _gather raises


def _settings(call, dropout_p: float) -> dict:
    """What every rank must agree on, by the name used in error messages."""
    batch, _, heads, head_dim = call.shape
    return {
        "batch": batch,
        "heads": heads,
        "head_dim": head_dim,
        "dtype": str(call.q.dtype),
        "device type": call.q.device.type,
        "mode": call.mode,
        "head_offsets": call.head_offsets,
        "is_causal": call.is_causal,
        "key_padding_mask (given or None)": call.padding is not None,
        "segment_lengths": list(call.segment_lengths),
        "dilation_rates": list(call.dilation_rates),
        "softmax_scale": call.scale,
        "dropout_p": dropout_p,
        # Every rank's backward exchanges gradients with its peers: all build the graph, or none.
        "whether the call records a graph for backward (grad mode on and q, k or v requiring grad; "
        "every rank must, and run the backward)": torch.is_grad_enabled()
        and any(t.requires_grad for t in (call.q, call.k, call.v)),
    }


def agree(group, call, dropout_p: float, error: Exception | None) -> tuple[list[int], int | None]:
    """All-gather every rank's configuration, or the error its input raised; return
    the shard lengths and rank 0's dropout seed (``None`` without dropout).

    Every rank raises the same error if any rank's input was bad (the first such
    rank's message) or if any setting differs between ranks (the values per rank)."""
    generator, state = None, None
    if error is None:
        if dropout_p > 0:
            # the seed travels with the settings; a call that raises leaves the generator as it was
            generator = _default_generator(call.q.device)
            state = None if generator is None else generator.get_state()
        seed = int(draw_seed(call.q.device)) if dropout_p > 0 else None
        mine = {"length": call.shape[1], "seed": seed, "settings": _settings(call, dropout_p)}
    else:
        mine = {"error": (type(error).__name__, str(error))}
    try:
        table = _gather(group, mine, error, "agree")
        _require_same(
            table, "every rank must call dilated_attention with the same configuration and only its own shard"
        )
    except (ValueError, TypeError):
        if generator is not None and state is not None:
            generator.set_state(state)
        raise
    return [entry["length"] for entry in table], table[0]["seed"]


def _require_same(table: list[dict], fix: str) -> None:
    """A ``ValueError`` naming the first of the ``"settings"`` in which the ranks'
    entries differ, with each rank's value, followed by ``fix``."""
    for name in table[0]["settings"]:
        values = [entry["settings"][name] for entry in table]
        if any(value != values[0] for value in values):
            raise ValueError(f"process_group ranks disagree on {name} (per rank: {values}); {fix}")


def _default_generator(device: torch.device) -> torch.Generator | None:
    """The generator :func:`draw_seed` draws from on ``device`` (``None`` where the
    device type keeps no default generators)."""
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    generators = getattr(module, "default_generators", None)
    if not generators:
        return None
    return generators[device.index if device.index is not None else module.current_device()]


@dataclass
class Exchange:
    """The transfers of one call: this rank's plan, the dropout seed (rank 0's, so that
    masks are those of one process), the communicator, and the rows received in
    forward (kept for backward: at most the selected rows of the segments this rank
    shares), as key sources with one block each."""

    communicator: Communicator
    plan: ShardPlan
    masked: bool
    batch: int
    dim: int
    dtype: torch.dtype
    device: torch.device
    seed: torch.Tensor | None = None
    traffic: Traffic = field(default_factory=Traffic)
    received: tuple = ((), ())
    _pending: list = field(default_factory=list)
    _incoming: dict = field(default_factory=dict)

    def __post_init__(self):
        # Per peer and head, the distinct rows that go to it / come from it.
        self.unions_to = {peer: _head_unions(rows, self.device) for peer, rows in self.plan.sends}
        self.unions_from = {
            peer: _head_unions([rows for rows, _ in pairs], self.device) for peer, pairs in self.plan.receives
        }

    def start_forward(self, k: torch.Tensor, v: torch.Tensor, padding: torch.Tensor | None) -> None:
        """Post the transfer of key/value rows. A message carries, per head, the union
        of the rows all branches need from that peer (each row once), then, with a
        mask, one mask value per distinct row."""
        outgoing = {}
        for peer, unions in self.unions_to.items():
            parts = [t[:, rows, head].reshape(-1) for t in (k, v) for head, rows in unions.items()]
            if self.masked:
                assert padding is not None  # masked: this call has a key padding mask
                parts.append(padding[:, _all_rows(unions)].to(k.dtype).reshape(-1))
            outgoing[peer] = torch.cat(parts)
        self._incoming = {}
        for peer, unions in self.unions_from.items():
            size = self._pair_size(unions) + (self.batch * len(_all_rows(unions)) if self.masked else 0)
            self._incoming[peer] = k.new_empty(size)
        self._pending = self.communicator.transfer(outgoing, self._incoming)
        self.communicator.traffic = self.traffic  # this call's, its backward included once run
        self.traffic.forward_sent = sum(_nbytes(t) for t in outgoing.values())
        self.traffic.forward_received = sum(_nbytes(t) for t in self._incoming.values())

    def finish_forward(self) -> tuple[list[KeySource], list[Block]]:
        """Wait for the rows; return them as key sources ``1, 2, ...``, each with the
        block of local queries that attends to it (all of it: the sender's rows all
        precede the queries when causal)."""
        for work in self._pending:
            work.wait()
        sources, blocks = [], []
        for peer, pairs in self.plan.receives:
            unions, buf = self.unions_from[peer], self._incoming[peer]
            per_head, at = self._unpack(buf, unions)
            mask_rows = _all_rows(unions)
            mask = buf[at:].view(self.batch, len(mask_rows)) != 0 if self.masked else None
            for rows, block in pairs:
                wanted = rows.positions(self.device).flatten()
                k_rows, v_rows = (  # (B, L, h, D)
                    torch.stack([t[h][:, torch.searchsorted(unions[h], wanted)] for h in rows.head_indices], 2)
                    for t in per_head
                )
                pad = None if mask is None else mask[:, torch.searchsorted(mask_rows, wanted)]
                first = self.plan.starts[peer] + rows.start + rows.offset
                sources.append(KeySource(k_rows, v_rows, pad, first, rows.rate, nonfinite_rows(k_rows, v_rows)))
                keys = Rows.strided(0, len(wanted), 1, slice(0, rows.head_count))
                blocks.append(Block(block.branch, block.queries, keys, False, False, source=len(sources)))
        self.received = (sources, blocks)
        return sources, blocks

    def start_backward(self, key_grads) -> None:
        """Post the return of the received rows' gradients (``(dk, dv)`` ``(B, L, h, D)``
        per source, summed here per distinct row) to their owners."""
        outgoing, index = {}, 0
        acc = accumulator(self.dtype)
        for peer, pairs in self.plan.receives:
            unions = self.unions_from[peer]
            sums = [
                {h: torch.zeros(self.batch, len(r), self.dim, dtype=acc, device=self.device) for h, r in unions.items()}
                for _ in range(2)
            ]
            for rows, _ in pairs:
                wanted = rows.positions(self.device).flatten()
                for grad, total in zip(key_grads[index], sums, strict=True):
                    for slot, h in enumerate(rows.head_indices):
                        total[h].index_add_(1, torch.searchsorted(unions[h], wanted), grad[:, :, slot].to(acc))
                index += 1
            outgoing[peer] = torch.cat([t.to(self.dtype).reshape(-1) for total in sums for t in total.values()])
        self._incoming = {
            peer: torch.empty(self._pair_size(unions), dtype=self.dtype, device=self.device)
            for peer, unions in self.unions_to.items()
        }
        self._pending = self.communicator.transfer(outgoing, self._incoming)
        self.traffic.backward_sent = sum(_nbytes(t) for t in outgoing.values())
        self.traffic.backward_received = sum(_nbytes(t) for t in self._incoming.values())

    def finish_backward(self, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Wait for the gradients of this rank's rows and add them into ``dk, dv``."""
        for work in self._pending:
            work.wait()
        for peer, unions in self.unions_to.items():
            halves, _ = self._unpack(self._incoming[peer], unions)
            for grad, rows_grads in zip((dk, dv), halves, strict=True):
                for head, rows in unions.items():
                    grad[:, :, head].index_add_(1, rows, rows_grads[head].to(grad.dtype))

    def _pair_size(self, unions) -> int:
        """Elements of a message's keys and values (or their gradients) for ``unions``
        (head -> rows): ``B x rows x D`` per head, twice."""
        return 2 * self.batch * self.dim * sum(len(rows) for rows in unions.values())

    def _unpack(self, buf: torch.Tensor, unions) -> tuple[list[dict[int, torch.Tensor]], int]:
        """A message's keys then values (or their gradients), each per head a ``(B, rows,
        D)`` view of ``buf``, as :meth:`start_forward` and :meth:`start_backward` pack
        them; and the offset where they end."""
        halves, at = [], 0
        for _ in range(2):
            views = {}
            for head, rows in unions.items():
                n = self.batch * len(rows) * self.dim
                views[head] = buf[at : at + n].view(self.batch, len(rows), self.dim)
                at += n
            halves.append(views)
        return halves, at


def _head_unions(entries, device) -> dict[int, torch.Tensor]:
    """Per head, the sorted distinct local rows that ``entries`` (:class:`Rows`) cover."""
    per_head: dict[int, list[torch.Tensor]] = {}
    for rows in entries:
        index = rows.positions(device).flatten()
        for head in rows.head_indices:
            per_head.setdefault(head, []).append(index)
    return {head: torch.unique(torch.cat(parts)) for head, parts in sorted(per_head.items())}


def _all_rows(unions: dict[int, torch.Tensor]) -> torch.Tensor:
    """The sorted distinct rows over all heads (one mask value each)."""
    return torch.unique(torch.cat(list(unions.values())))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def make_exchange(process_group, call, dropout_p: float, error: Exception | None) -> Exchange:
    """Check that the ranks' inputs are valid and agree (see :func:`agree`), and plan
    this rank's part. ``process_group``: a group or a :class:`Communicator`; ``call``:
    this rank's validated call, or ``None`` with the ``error`` its validation raised."""
    communicator = communicator_of(process_group)
    group = communicator.group
    lengths, seed = agree(group, call, dropout_p, error)
    batch, _, heads, dim = call.shape
    plan = make_shard_plan(
        lengths,
        dist.get_rank(group),
        heads,
        call.segment_lengths,
        call.dilation_rates,
        call.mode,
        call.is_causal,
        call.head_offsets,
    )
    device = call.q.device
    seed_tensor = None if seed is None else torch.tensor(seed, dtype=torch.int64, device=device)
    return Exchange(communicator, plan, call.padding is not None, batch, dim, call.q.dtype, device, seed_tensor)


def shard_start(process_group, length: int, settings: dict | None = None) -> int:
    """The sequence position of this rank's first row, given its shard's ``length``:
    the lower ranks' lengths summed (one small all-gather). ``settings`` (name ->
    value; a model's configuration): every rank raises the same ``ValueError`` where
    they differ between ranks, before a model whose layers differ makes unlike calls."""
    group = communicator_of(process_group).group
    table = _gather(group, {"length": int(length), "settings": settings or {}}, step="shard_start")
    _require_same(table, "every rank must run the same model (the same config) on its own shard of the sequence")
    return sum(entry["length"] for entry in table[: dist.get_rank(group)])
