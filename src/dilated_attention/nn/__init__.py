"""``torch.nn`` layers over the operator: :class:`DilatedAttention`,
:class:`MultiheadDilatedAttention`, :class:`GridAttention` (image patches in a chosen
:mod:`ordering`), the decoding caches :class:`DilatedKVCache` and
:class:`StaticKVCache`, and rotary position embeddings."""

from .cache import DilatedKVCache
from .modules import DilatedAttention, GridAttention, MultiheadDilatedAttention
from .static_cache import StaticKVCache

__all__ = ["DilatedAttention", "DilatedKVCache", "GridAttention", "MultiheadDilatedAttention", "StaticKVCache"]
