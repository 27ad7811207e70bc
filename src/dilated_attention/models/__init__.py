"""LongNet language models built on the library's layers.

- :class:`LongNetConfig` (presets ``tiny``, ``small``, ``paper_base``) and
  :class:`LongNetLM`: a decoder-only Transformer with causal dilated attention.
- :func:`generate`, :func:`stream`: sampling through the model's bounded cache.
"""

from .config import PRESETS, LongNetConfig
from .generate import generate, sample_next, stream
from .longnet import LongNetCache, LongNetLM

__all__ = ["PRESETS", "LongNetCache", "LongNetConfig", "LongNetLM", "generate", "sample_next", "stream"]
