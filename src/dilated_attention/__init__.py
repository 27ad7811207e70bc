"""Exact LongNet dilated attention for PyTorch.

- :func:`dilated_attention`: the functional API (``(B, N, H, D)`` tensors).
- :class:`DilatedAttention`, :class:`MultiheadDilatedAttention`: ``nn.Module`` wrappers.
- :mod:`dilated_attention.reference`: a dense float64 reference of ``SPEC.md``.
"""

from .functional import dilated_attention
from .modules import DilatedAttention, MultiheadDilatedAttention
from .reference import reference_dilated_attention

__all__ = [
    "dilated_attention",
    "DilatedAttention",
    "MultiheadDilatedAttention",
    "reference_dilated_attention",
]
__version__ = "0.1.0"
