"""Exact LongNet dilated attention for PyTorch.

- :func:`dilated_attention`: the functional API (``(B, N, H, D)`` tensors).
- :class:`DilatedAttention`, :class:`MultiheadDilatedAttention`: ``nn.Module`` wrappers.
- :class:`GridAttention`: attention over image patches in a chosen order
  (:mod:`dilated_attention.nn.ordering`: row-major, Z-order, Hilbert).
- :class:`DilatedKVCache`: attention fed a few positions at a time (decoding), in
  memory bounded by the longest segment; :class:`StaticKVCache` the same with fixed
  shapes, for ``torch.compile`` and CUDA graphs.
- :mod:`dilated_attention.reference`: a dense float64 reference of the definition.

What is computed, exactly, is defined in ``docs/definition.md`` of the project.
"""

from .functional import dilated_attention
from .nn import ordering as ordering  # re-exported: from dilated_attention import ordering
from .nn.cache import DilatedKVCache
from .nn.modules import DilatedAttention, GridAttention, MultiheadDilatedAttention
from .nn.static_cache import StaticKVCache
from .reference import reference_dilated_attention

__all__ = [
    "DilatedAttention",
    "DilatedKVCache",
    "GridAttention",
    "MultiheadDilatedAttention",
    "StaticKVCache",
    "dilated_attention",
    "reference_dilated_attention",
]
__version__ = "0.1.0"
