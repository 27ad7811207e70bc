"""Dropout masks that are a pure function of where a probability sits.

Whether the attention probability of query position ``p`` to key position ``k``
(batch row ``b``, head ``h``) is kept depends only on ``(seed, b, h, p, k)``: a
32-bit hash of those integers compared with ``dropout_p * 2**32``. So the same
seed gives the same mask however the work is cut into kernel calls, chunks of
queries, or the shards of several processes, and the backward pass regenerates
the forward's mask exactly from the positions alone. The seed is a tensor, drawn
from PyTorch's generator of the inputs' device, so ``torch.compile`` traces it.

The hash is two rounds of xor-shift-multiply on 32-bit words held in int64
(multipliers below ``2**31``, so no product overflows): strong row and column keys
are built once per call, and each (row, column) pair is mixed from their xor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_WORD = 0xFFFFFFFF
_ROW_SALT = 0x2545F491
_COLUMN_SALT = 0x6A09E667
SEED_BOUND = 2**62  # seeds are drawn uniformly from [0, SEED_BOUND)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijective avalanche hash of 32-bit words (int64 tensor in ``[0, 2**32)``),
    computed in place: ``x`` must be a fresh tensor, which it returns."""
    x.bitwise_xor_(x >> 16).mul_(0x21F0AAAD).bitwise_and_(_WORD)
    x.bitwise_xor_(x >> 15).mul_(0x735A2D97).bitwise_and_(_WORD)
    return x.bitwise_xor_(x >> 15)


def _absorb(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Fold a non-negative int64 ``value`` (broadcastable to ``key``) into ``key``."""
    return _mix(_mix(key ^ (value & _WORD)) ^ (value >> 32))


def draw_seed(device: torch.device) -> torch.Tensor:
    """A 0-dim int64 seed from the default generator of ``device``."""
    return torch.randint(0, SEED_BOUND, (), dtype=torch.int64, device=device)


def row_keys(
    seed: torch.Tensor, batch_rows: torch.Tensor, heads: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Keys of query rows, ``(len(batch_rows), *positions.shape, len(heads))`` int64.

    ``batch_rows``: ``(B,)`` batch row indices; ``heads``: ``(h,)`` absolute head
    indices; ``positions``: absolute query positions (any shape, int64)."""
    key = _absorb(torch.full((), _ROW_SALT, dtype=torch.int64, device=positions.device), seed)
    key = _absorb(key, batch_rows.view(-1, *([1] * (positions.dim() + 1))))
    key = _absorb(key, heads.view(*([1] * (positions.dim() + 1)), -1))
    return _absorb(key, positions.unsqueeze(-1).unsqueeze(0))


def column_keys(positions: torch.Tensor) -> torch.Tensor:
    """Keys of key columns: the hash of their absolute positions (same shape)."""
    return _absorb(torch.full((), _COLUMN_SALT, dtype=torch.int64, device=positions.device), positions)


@dataclass(frozen=True)
class DropoutMask:
    """The dropout of one kernel call, in kernel layout: ``rows`` ``(B', h, Lq)`` and
    ``columns`` ``(B', 1, Lk)`` keys (int64); probability ``p`` of dropping."""

    p: float
    rows: torch.Tensor
    columns: torch.Tensor

    def multiplier(self, queries: slice, keys: slice, dtype: torch.dtype) -> torch.Tensor:
        """``keep / (1 - p)`` for query rows ``queries`` and key columns ``keys``:
        ``(B', h, len(queries), len(keys))`` in ``dtype``."""
        pair = _mix(self.rows[:, :, queries, None] ^ self.columns[:, :, None, keys])
        keep = pair >= int(self.p * 2**32)
        return keep.to(dtype) / (1.0 - self.p)
