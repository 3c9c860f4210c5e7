"""What the parts of the PyTorch backend (codec, generate, import check) read from it.

``PyTorchBackend`` satisfies ``TorchRuntime``; the parts take the protocol, so they never
import the backend module that imports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class TorchRuntime(Protocol):
    """The loaded model, its cache layout and the cache operations the parts use."""

    # torch, safetensors.torch, the model and its tokenizer: framework objects.
    torch: Any
    safetensors: Any
    model: Any
    tokenizer: Any
    device: Any
    dtype: Any
    cache_arg: str
    prefill_chunk: int
    num_layers: int
    kv_heads: int
    head_dim: int
    layers: list[dict[str, Any]] | None
    eos_ids: set[int]

    def new_cache(self) -> Any: ...

    def kv_pairs(self, cache: Any) -> list[tuple[Any, Any]]: ...

    def length(self, cache: Any) -> int: ...

    def forward(self, cache: Any, tokens: Sequence[int]) -> Any: ...

    def prefill(self, cache: Any, tokens: list[int]) -> Any: ...

    def clone(self, cache: Any) -> Any: ...
