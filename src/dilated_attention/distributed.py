"""Sequence parallelism over ``torch.distributed``: the exchanges between ranks.

Rank ``k`` of a process group holds the ``k``-th contiguous shard of ``q, k, v``.
:func:`dilated_attention.plan.make_shard_plan` says which rows of its keys and
values each peer needs (only the selected rows of segments they share); this module
checks that all ranks agree on the configuration, packs those rows into one message
per peer, exchanges them with ``batch_isend_irecv`` while the local blocks compute,
and, in backward, sends the gradients of the received rows back to their owners.

:func:`traffic` reports the bytes this rank sent and received in the last forward
and backward.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .engine import RemoteKeys, _to_kernel
from .plan import ShardPlan, make_shard_plan

_DTYPE_CODES = {torch.float64: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


@dataclass
class Traffic:
    """Bytes of attention data this rank sent and received (configuration checks and
    shard lengths, a few integers per call, are not counted)."""

    forward_sent: int = 0
    forward_received: int = 0
    backward_sent: int = 0
    backward_received: int = 0


_LAST_TRAFFIC = Traffic()


def traffic() -> Traffic:
    """The :class:`Traffic` of this process's last sequence-parallel forward and backward."""
    return Traffic(**vars(_LAST_TRAFFIC))


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


_FIELDS = (
    "batch", "heads", "head_dim", "dtype", "mode", "is_causal", "key_padding_mask",
    "segment_lengths/dilation_rates", "softmax_scale", "dropout_p", "device type",
)


def agree_on_layout(group, q: torch.Tensor, segment_lengths, dilation_rates, mode: str,
                    is_causal: bool, masked: bool, scale: float, dropout_p: float) -> list[int]:
    """All-gather every rank's configuration; return the shard lengths, or raise
    ``ValueError`` on every rank if any setting differs between ranks."""
    batch, local_len, heads, head_dim = q.shape
    branches = zlib.crc32(repr((tuple(segment_lengths), tuple(dilation_rates))).encode())
    mine = [
        local_len, batch, heads, head_dim, _DTYPE_CODES[q.dtype], int(mode == "mixture"), int(is_causal),
        int(masked), branches, _float_bits(scale), _float_bits(dropout_p), int(q.device.type == "cuda"),
    ]
    device = q.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    local = torch.tensor(mine, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    table = torch.stack(gathered).cpu().tolist()
    for column, name in enumerate(_FIELDS, start=1):
        values = [row[column] for row in table]
        if len(set(values)) > 1:
            raise ValueError(
                f"process_group ranks disagree on {name} (per rank: {values}); every rank must call "
                "dilated_attention with the same configuration and only its own shard of the sequence"
            )
    return [row[0] for row in table]


def _global(group, peer: int) -> int:
    return dist.get_global_rank(group, peer) if group is not None else peer


@dataclass
class Sharding:
    """The process group, this rank's plan, and the received rows of one call (kept
    for backward: at most the selected rows of the segments this rank shares)."""

    group: object
    plan: ShardPlan
    masked: bool
    batch: int
    dim: int
    dtype: torch.dtype
    device: torch.device
    pieces: list = field(default_factory=list)

    def _exchange(self, outgoing: dict[int, torch.Tensor], incoming: dict[int, torch.Tensor]):
        ops = [dist.P2POp(dist.isend, buf, _global(self.group, peer), self.group) for peer, buf in outgoing.items()]
        ops += [dist.P2POp(dist.irecv, buf, _global(self.group, peer), self.group) for peer, buf in incoming.items()]
        return dist.batch_isend_irecv(ops) if ops else []

    def send_keys(self, k: torch.Tensor, v: torch.Tensor, padding: Optional[torch.Tensor]):
        """Post the exchange of key/value rows; return a callable that waits for it and
        gives the :class:`RemoteKeys` of this rank's queries."""
        batch, _, _, dim = k.shape
        outgoing = {}
        for peer, rows_list in self.plan.sends:
            parts = []
            for rows in rows_list:
                parts += [rows.select(k).reshape(-1), rows.select(v).reshape(-1)]
                if self.masked:
                    parts.append(rows.select(padding).to(k.dtype).reshape(-1))
            outgoing[peer] = torch.cat(parts)
        sizes = {}
        for peer, pairs in self.plan.receives:
            sizes[peer] = sum(
                batch * rows.count * (2 * _heads(rows) * dim + (1 if self.masked else 0)) for rows, _ in pairs
            )
        incoming = {peer: k.new_empty(size) for peer, size in sizes.items()}
        works = self._exchange(outgoing, incoming)
        _LAST_TRAFFIC.forward_sent = sum(_nbytes(t) for t in outgoing.values())
        _LAST_TRAFFIC.forward_received = sum(_nbytes(t) for t in incoming.values())
        _LAST_TRAFFIC.backward_sent = _LAST_TRAFFIC.backward_received = 0

        def finish():
            for work in works:
                work.wait()
            for peer, pairs in self.plan.receives:
                buf, at = incoming[peer], 0
                for rows, block in pairs:
                    shape = (batch, rows.count, _heads(rows), dim)
                    kv = []
                    for _ in range(2):
                        n = math.prod(shape)
                        kv.append(buf[at : at + n].view(shape))
                        at += n
                    pad = None
                    if self.masked:
                        pad = buf[at : at + batch * rows.count].view(batch, rows.count) != 0
                        at += batch * rows.count
                    self.pieces.append(RemoteKeys(block, _to_kernel(kv[0][:, None]), _to_kernel(kv[1][:, None]), pad))
            return self.pieces

        return finish

    def send_key_grads(self, remote_grads):
        """Post the return of the received rows' gradients to their owners; return a
        callable that waits and gives ``[(rows, dk, dv), ...]`` for this rank's rows."""
        outgoing, index = {}, 0
        for peer, pairs in self.plan.receives:
            parts = []
            for _ in pairs:
                dk, dv = remote_grads[index]
                index += 1
                parts += [t.transpose(1, 2).to(self.dtype).reshape(-1) for t in (dk, dv)]
            outgoing[peer] = torch.cat(parts)
        incoming = {}
        for peer, rows_list in self.plan.sends:
            size = sum(2 * self.batch * rows.count * _heads(rows) * self.dim for rows in rows_list)
            incoming[peer] = torch.empty(size, dtype=self.dtype, device=self.device)
        works = self._exchange(outgoing, incoming)
        _LAST_TRAFFIC.backward_sent = sum(_nbytes(t) for t in outgoing.values())
        _LAST_TRAFFIC.backward_received = sum(_nbytes(t) for t in incoming.values())

        def finish():
            for work in works:
                work.wait()
            result = []
            for peer, rows_list in self.plan.sends:
                buf, at = incoming[peer], 0
                for rows in rows_list:
                    shape = (self.batch, rows.count, _heads(rows), self.dim)
                    n = math.prod(shape)
                    result.append((rows, buf[at : at + n].view(shape), buf[at + n : at + 2 * n].view(shape)))
                    at += 2 * n
            return result

        return finish


def _heads(rows) -> int:
    return len(range(rows.heads.start, rows.heads.stop, rows.heads.step or 1))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def make_sharding(group, q, segment_lengths, dilation_rates, mode, is_causal, masked, scale, dropout_p) -> Sharding:
    """Check the ranks agree, and plan this rank's part."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "process_group was given but torch.distributed is not initialized: call "
            "torch.distributed.init_process_group first, or pass process_group=None for one process"
        )
    lengths = agree_on_layout(group, q, segment_lengths, dilation_rates, mode, is_causal, masked, scale, dropout_p)
    rank = dist.get_rank(group)
    plan = make_shard_plan(lengths, rank, q.shape[2], segment_lengths, dilation_rates, mode, is_causal)
    return Sharding(group, plan, masked, q.shape[0], q.shape[3], q.dtype, q.device)
