"""Exact LongNet dilated attention for PyTorch.

- :func:`dilated_attention`: the functional API (``(B, N, H, D)`` tensors).
- :class:`DilatedAttention`, :class:`MultiheadDilatedAttention`: ``nn.Module`` wrappers.
- :mod:`dilated_attention.reference`: a dense float64 reference of the definition.

What is computed, exactly, is defined in ``docs/definition.md`` of the project.
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
