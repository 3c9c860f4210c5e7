"""What the parts of the mlx-lm backend (codec, files, generate, import check) read from it.

``MlxBackend`` satisfies ``MlxRuntime``; the parts take the protocol, so they never import
the backend module that imports them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

#: A layer description as ``local.mlx_format.describe_layer`` writes it.
LayerInfo = dict[str, Any]


class MlxRuntime(Protocol):
    """The loaded model, its cache layout and the cache operations the parts use."""

    # mlx.core, mlx_lm.models.cache and the model: framework objects without stubs.
    mx: Any
    cache_mod: Any
    model: Any
    lock: threading.RLock
    format: str
    mlx_lm_version: str
    mlx_version: str
    prefill_step: int
    kv_bits: int | None
    kv_group_size: int
    quantized_kv_start: int
    layers: list[LayerInfo] | None
    num_layers: int
    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: str
    eos_ids: set[int]

    def size(self, cache: Sequence[Any]) -> int: ...

    def new_cache(self) -> list[Any]: ...

    def copy_cache(self, cache: Sequence[Any], keep: int | None = None) -> list[Any]: ...

    def expected_layout(self, token_count: int) -> tuple[list[str], list[LayerInfo] | None]: ...

    def prefill(self, cache: Sequence[Any] | None, tokens: Sequence[int]) -> list[Any]: ...

    def trim(self, cache: Sequence[Any], keep_tokens: int) -> list[Any]: ...
