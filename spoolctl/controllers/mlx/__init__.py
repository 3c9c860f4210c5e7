"""The mlx-lm controller and backend, and the mlx-vlm ones (``vlm``, ``vlm_backend``).

Importing the package imports no framework: ``mlx`` / ``mlx_lm`` load when a backend is
built.
"""

from __future__ import annotations

from ..local.mlx_format import CacheFormatError, PromptCache, cache_format
from .backend import (
    FAMILY_CLASSES,
    KIND,
    KV_BITS,
    KV_GROUP_SIZE,
    KV_GROUP_SIZES,
    PREFILL_STEP,
    QUANTIZED_KV_START,
    REFUSED_MODEL_TYPES,
    MlxBackend,
)
from .codec import OBJECT_NAME
from .controller import MlxCacheController
from .files import TOKENS_META

__all__ = [
    "FAMILY_CLASSES",
    "KIND",
    "KV_BITS",
    "KV_GROUP_SIZE",
    "KV_GROUP_SIZES",
    "OBJECT_NAME",
    "PREFILL_STEP",
    "QUANTIZED_KV_START",
    "REFUSED_MODEL_TYPES",
    "TOKENS_META",
    "CacheFormatError",
    "MlxBackend",
    "MlxCacheController",
    "PromptCache",
    "cache_format",
]
