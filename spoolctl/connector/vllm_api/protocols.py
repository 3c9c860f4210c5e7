"""The vLLM objects the connector reads, as protocols of the attributes it reads directly.

vLLM's own classes satisfy them structurally, and so do the plain objects tests build; no
vLLM import. Attributes the connector reads with ``getattr`` and a default (they differ
between vLLM releases) are not listed: a missing one means its default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class KVTransferConfigLike(Protocol):
    """vLLM's ``KVTransferConfig``."""

    @property
    def kv_connector_extra_config(self) -> Mapping[str, Any]: ...  # the operator's JSON


class CacheConfigLike(Protocol):
    """vLLM's ``CacheConfig``."""

    @property
    def block_size(self) -> int: ...

    @property
    def cache_dtype(self) -> str: ...


class ParallelConfigLike(Protocol):
    """vLLM's ``ParallelConfig``."""

    @property
    def tensor_parallel_size(self) -> int: ...

    @property
    def pipeline_parallel_size(self) -> int: ...


class ModelConfigLike(Protocol):
    """vLLM's ``ModelConfig``. ``dtype`` is a name or a ``torch.dtype``."""

    @property
    def model(self) -> str: ...

    @property
    def dtype(self) -> object: ...

    # ``parallel_config`` is vLLM's own ``ParallelConfig``: the one this config came with.
    def get_num_layers(self, parallel_config: Any) -> int: ...

    def get_num_kv_heads(self, parallel_config: Any) -> int: ...

    def get_head_size(self) -> int: ...


class VllmConfigLike(Protocol):
    """vLLM's ``VllmConfig``. A KV connector is only built with a ``kv_transfer_config``."""

    @property
    def kv_transfer_config(self) -> KVTransferConfigLike | None: ...

    @property
    def cache_config(self) -> CacheConfigLike: ...

    @property
    def parallel_config(self) -> ParallelConfigLike: ...

    @property
    def model_config(self) -> ModelConfigLike: ...


class KVCacheGroupLike(Protocol):
    """vLLM's ``KVCacheGroupSpec``: the layers of one KV cache group and their spec."""

    @property
    def layer_names(self) -> Sequence[str]: ...

    @property
    def kv_cache_spec(self) -> object: ...


class LayerSpecLike(Protocol):
    """One layer's ``KVCacheSpec`` as it declares its page (newer vLLM; refused without)."""

    @property
    def dtype(self) -> Any: ...  # a torch.dtype: its itemsize or element_size() is read

    @property
    def num_heads(self) -> int: ...

    @property
    def num_states(self) -> int: ...

    @property
    def state_content_size_bytes(self) -> int: ...


class KVCacheTensorLike(Protocol):
    """vLLM's ``KVCacheTensor``: one backing buffer and the layers sharing it."""

    @property
    def layers(self) -> Sequence[str]: ...

    @property
    def layer_stride(self) -> int: ...

    @property
    def block_stride(self) -> int: ...


class KVCacheConfigLike(Protocol):
    """vLLM's ``KVCacheConfig`` (its groups and tensors are read with ``getattr``)."""

    @property
    def num_blocks(self) -> int: ...


class KVCacheBlocksLike(Protocol):
    """vLLM's ``KVCacheBlocks``: the blocks allocated to one request."""

    def get_block_ids(self) -> tuple[list[int], ...]: ...  # per KV cache group


class RequestLike(Protocol):
    """vLLM's ``Request`` as the scheduler sees it."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> Sequence[int] | None: ...


class NewRequestLike(Protocol):
    """vLLM's ``NewRequestData``: a request scheduled for the first time."""

    @property
    def req_id(self) -> str: ...

    @property
    def block_ids(self) -> tuple[list[int], ...]: ...

    @property
    def num_computed_tokens(self) -> int: ...


class CachedRequestsLike(Protocol):
    """vLLM's ``CachedRequestData``: the running and resumed requests, column-wise."""

    @property
    def req_ids(self) -> Sequence[str]: ...

    @property
    def num_computed_tokens(self) -> Sequence[int]: ...

    @property
    def new_block_ids(self) -> Sequence[tuple[list[int], ...] | None]: ...

    @property
    def resumed_req_ids(self) -> set[str]: ...


class SchedulerOutputLike(Protocol):
    """vLLM's ``SchedulerOutput``: what one engine step computes."""

    @property
    def num_scheduled_tokens(self) -> Mapping[str, int]: ...

    @property
    def scheduled_new_reqs(self) -> Sequence[NewRequestLike]: ...

    @property
    def scheduled_cached_reqs(self) -> CachedRequestsLike: ...
