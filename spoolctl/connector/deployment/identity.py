"""Deployment identity: what must match for stored KV to be valid (pure; no vLLM import).

The identity binds the model locator and revision, the model and KV cache
dtypes, the block size, the runtime KV cache layout (every KV cache group's
layer names and spec), the TP/PP topology and this rank's place in it, the
engine's KV layout generation (vLLM major.minor and attention backend), the
connector's format version and the content digest of the model's files
(``weights``). Its digest is the store namespace, so a different
deployment is a different namespace and can never read another's KV. It is
derived from vLLM's public config objects by attribute access only.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spoolctl.store import hash_bytes

if TYPE_CHECKING:
    from ..vllm_api.protocols import VllmConfigLike

FORMAT_VERSION = 1
NAMESPACE_PREFIX = "vllm-v1-"


@dataclass(frozen=True)
class DeploymentIdentity:
    """Everything that makes stored KV valid for a rank. ``namespace`` is its digest."""

    model: str
    revision: str | None
    dtype: str
    kv_cache_dtype: str
    block_size: int
    kv_layout: tuple[Mapping[str, Any], ...]
    tp_size: int
    pp_size: int
    tp_rank: int
    pp_rank: int
    engine: str
    chunk_tokens: int
    format_version: int = FORMAT_VERSION
    # What the model's files are (``weights.weights_digest`` or the operator's
    # ``spoolctl_weights_id``): new weights at the same path are a new namespace.
    weights: str | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model locator must not be empty")
        if self.block_size <= 0 or self.chunk_tokens <= 0:
            raise ValueError("block size and chunk size must be positive")
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError("rank outside the parallel topology")

    def to_json(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["kv_layout"] = [dict(g) for g in self.kv_layout]
        if self.weights is None:  # identities made without weights keep their namespace
            del doc["weights"]
        return doc

    @property
    def namespace(self) -> str:
        data = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return NAMESPACE_PREFIX + hash_bytes(data.encode())[:48]

    def for_rank(self, *, tp_rank: int, pp_rank: int) -> DeploymentIdentity:
        return dataclasses.replace(self, tp_rank=tp_rank, pp_rank=pp_rank)

    def summary(self) -> dict[str, Any]:
        """Small, non-secret facts recorded in manifests (for `spoolctl inspect`)."""
        return {"model": self.model, "revision": self.revision, "dtype": self.dtype,
                "kv_cache_dtype": self.kv_cache_dtype, "block_size": self.block_size,
                "tp": [self.tp_rank, self.tp_size], "pp": [self.pp_rank, self.pp_size],
                "engine": self.engine, "chunk_tokens": self.chunk_tokens,
                "weights": self.weights}


def _plain(value: Any) -> Any:
    """A JSON-safe, deterministic rendering of a config value (dtypes, enums, nested specs)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return str(value.value) if isinstance(value.value, (str, int)) else value.name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def kv_layout_of(kv_cache_config: object, *,
                 with_layers: bool = True) -> tuple[dict[str, Any], ...]:
    """The layout part of vLLM's ``KVCacheConfig``: per group, layer names + spec type/fields.

    ``num_blocks`` and tensor sizes are left out on purpose: they depend on free
    memory at startup, not on what a block holds. ``with_layers=False`` leaves the layer
    names out: under pipeline parallelism every stage (and the scheduler, which gets
    stage 0's config) sees only its own layers, while the identity must be the same on
    every rank. A stage's layer names are still bound per chunk (the ``layout`` digest
    in each manifest, checked before every restore).
    """
    groups = []
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = group.kv_cache_spec
        doc: dict[str, Any] = {"spec": type(spec).__name__, "fields": _plain(spec)}
        if with_layers:
            doc = {"layers": list(group.layer_names), **doc}
        groups.append(doc)
    return tuple(groups)


def identity_from_vllm(
    vllm_config: VllmConfigLike, kv_cache_config: object, *, chunk_tokens: int, engine: str,
    tp_rank: int = 0, pp_rank: int = 0, group_format: list[dict[str, Any]] | None = None,
    weights: str | None = None,
) -> DeploymentIdentity:
    """Derive the identity from vLLM's ``VllmConfig`` and runtime ``KVCacheConfig``.

    ``group_format`` (the grouped format's per-group object layout, see ``groups``) is
    bound into every group's layout entry, so grouped and single-object entries of the
    same model never share a namespace; None leaves existing namespaces unchanged.
    """
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    par = vllm_config.parallel_config
    revision = getattr(model, "revision", None)
    layout = kv_layout_of(kv_cache_config, with_layers=int(par.pipeline_parallel_size) == 1)
    if group_format is not None:
        if len(group_format) != len(layout):
            raise ValueError("one stored-format description per KV cache group")
        layout = tuple({**g, "stored": dict(f)} for g, f in zip(layout, group_format,
                                                                  strict=True))
    return DeploymentIdentity(
        model=str(model.model),
        revision=None if revision is None else str(revision),
        dtype=str(model.dtype),
        kv_cache_dtype=str(cache.cache_dtype),
        block_size=int(cache.block_size),
        # PP > 1: stage-independent (see kv_layout_of); PP = 1 keeps existing namespaces.
        kv_layout=layout,
        tp_size=int(par.tensor_parallel_size),
        pp_size=int(par.pipeline_parallel_size),
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        engine=engine,
        chunk_tokens=chunk_tokens,
        weights=weights,
    )
