"""The deployment identity the tier binds into every key, from vLLM's offloading config.

Attribute access only on vLLM's config objects (``OffloadingConfig``, ``VllmConfig``); the
weights digest is the connector's (``deployment.weights``). Refusals are one ConfigError line.
"""

from __future__ import annotations

import os
from typing import Any

from spoolctl.connector.deployment.weights import (
    memo_dir_for,
    resolve_model_dir,
    weights_digest,
)
from spoolctl.errors import ConfigError

from .settings import TierSettings

IDENTITY_VERSION = 1


def weights_of(model: str, settings: TierSettings, revision: str | None) -> str:
    """The operator's ``weights_id``, else the content digest of the model's files: for a
    hub id, those of the ``revision`` the engine loaded (None: the default branch)."""
    if settings.weights_id is not None:
        return f"id:{settings.weights_id}"
    model_dir = resolve_model_dir(model, revision)
    if model_dir is None:
        raise ConfigError(f"SpoolTier cannot find the files of model {model!r} to digest "
                          "its weights", fix='set "weights_id" in the SpoolTier entry to a '
                                            "name that changes whenever the weights do")
    return weights_digest(model_dir, memo_dir=memo_dir_for(settings.weights_memo)).digest


def tier_identity(config: Any, block_size_bytes: int, weights: str,
                  engine: str, computation: str | None) -> dict[str, Any]:
    """What must match for a stored chunk to be valid (``config``: vLLM's OffloadingConfig;
    ``engine``: vLLM's major.minor and device type, whose KV byte layout the chunks are in;
    ``computation``: the digest of the model settings that change its KV)."""
    parallel = config.parallel
    agnostic = bool(parallel.is_parallelism_agnostic or config.replicated_layout)
    return {
        "version": IDENTITY_VERSION,
        "engine": engine,
        "model": config.model.name,
        "weights": weights,
        "computation": computation,
        "kv_dtype": str(config.model.dtype),
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "chunk_bytes": block_size_bytes,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "parallel": "agnostic" if agnostic else [
            parallel.tp_size, parallel.pp_size, parallel.pcp_size, parallel.dcp_size],
        "layout": [bool(config.canonical_layout), config.kv_cache_layout,
                   bool(config.replicated_layout)],
    }


def python_hash_seed() -> str | None:
    return os.environ.get("PYTHONHASHSEED")
