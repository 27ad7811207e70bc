"""Rotary position embeddings (Su et al., 2021) at absolute positions.

A query at position ``m`` and a key at position ``n`` rotated by :class:`RotaryEmbedding`
score ``q_m . k_n`` as a function of ``m - n`` only. Because the rotation depends on
the absolute position alone, a sequence fed whole, in chunks through a cache, or
split across processes gets the same rotated rows, so every such path computes the
same attention.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import validation


class RotaryEmbedding(nn.Module):
    """Rotates channel pairs ``(i, i + D/2)`` of each head by ``position * base ** (-2i / D)``
    radians (the "rotate half" convention of GPT-NeoX and LLaMA).

    ``head_dim``: ``D``, even. The angles are computed in float64 from the integer
    positions (float32 angles lose about ``position * 6e-8`` radians: 0.06 at position
    one million), then the rotation runs in the input's dtype. No tables are kept.
    """

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        validation.check_positive_int(head_dim, "head_dim")
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings (channel pairs), got {head_dim}")
        self.head_dim = int(head_dim)
        self.base = validation.check_number(base, "base", 1, low_open=True)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` ``(B, N, H, D)``, ``positions`` integer ``(N,)`` or ``(B, N)`` -> rotated ``(B, N, H, D)``."""
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"x must have shape (batch, seq_len, heads, head_dim={self.head_dim}), got {tuple(x.shape)}"
            )
        check_rotary_positions(positions, x.shape[0], x.shape[1])
        half = self.head_dim // 2
        exponents = torch.arange(half, dtype=torch.float64, device=x.device) * (-2.0 / self.head_dim)
        angles = positions.to(x.device, torch.float64)[..., None] * torch.pow(self.base, exponents)
        cos, sin = (f(angles).to(x.dtype).unsqueeze(-2) for f in (torch.cos, torch.sin))  # (..., N, 1, D/2)
        first, second = x[..., :half], x[..., half:]
        return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)

    def get_extra_state(self) -> dict:
        return {"head_dim": self.head_dim, "base": self.base}

    def set_extra_state(self, state) -> None:
        validation.check_saved_config(self, dict(state), self.get_extra_state())

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}"


def check_rotary_positions(positions, batch: int, length: int) -> None:
    """``positions`` must be an integer tensor ``(length,)`` or ``(batch, length)``."""
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a tensor of integer positions, got {validation.type_name(positions)}")
    integers = not (positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool)
    if not integers or positions.shape not in ((length,), (batch, length)):
        raise ValueError(
            f"positions must be integers of shape (seq_len,) or (batch, seq_len) = {(batch, length)}, "
            f"got {positions.dtype} of shape {tuple(positions.shape)}"
        )
