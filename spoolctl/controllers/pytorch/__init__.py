"""The transformers controller and backend (``spoolctl[torch]``).

Importing the package imports no framework: torch and transformers load when a backend is
built.
"""

from __future__ import annotations

from .backend import DTYPES, PREFILL_CHUNK, PyTorchBackend
from .codec import KV_OBJECT
from .controller import PyTorchCacheController
from .frameworks import cache_argument, model_digest, quiet_frameworks

__all__ = [
    "DTYPES",
    "KV_OBJECT",
    "PREFILL_CHUNK",
    "PyTorchBackend",
    "PyTorchCacheController",
    "cache_argument",
    "model_digest",
    "quiet_frameworks",
]
