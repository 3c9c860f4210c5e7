"""How an ``OffloadKey`` and the deployment identity become a store entry (pure; no vLLM).

An entry is named ``(kind "vllm", namespace, key)``:

* ``namespace``: ``vllm-tier-v1-`` and the digest of the deployment identity (model, its
  weights digest, KV dtype and layout, block sizes, parallelism), so another model, new
  weights at the same path or another layout never finds these entries.
* ``key``: the ``OffloadKey`` in hex (vLLM's block hash chain and KV group index). The
  chain already binds the request's ``cache_salt`` and LoRA name into the first block.

The key is stable across restarts only when vLLM's block hashes are: a cryptographic
prefix-caching hash (``sha256``, ``sha256_cbor``) seeds the chain with a fixed value, while
``xxhash``/``xxhash_cbor`` seed it randomly per process unless ``PYTHONHASHSEED`` is set.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from spoolctl.errors import ConfigError
from spoolctl.store import hash_bytes

KIND = "vllm"
NAMESPACE_PREFIX = "vllm-tier-v1-"
OBJECT = "kv"
STABLE_HASHES = frozenset({"sha256", "sha256_cbor"})
SEEDED_HASHES = frozenset({"xxhash", "xxhash_cbor"})


def namespace_of(identity: Mapping[str, Any]) -> str:
    """The store namespace of a deployment identity (a JSON-able mapping)."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return NAMESPACE_PREFIX + hash_bytes(text.encode())[:48]


def entry_key(offload_key: bytes) -> str:
    """The store key of one offloaded chunk."""
    return offload_key.hex()


def check_stable_hashing(algo: str | None, python_hash_seed: str | None) -> None:
    """ConfigError unless block hashes made with ``algo`` survive a restart."""
    if algo in STABLE_HASHES:
        return
    if algo in SEEDED_HASHES:
        if python_hash_seed is not None:
            return
        raise ConfigError(f"SpoolTier needs block hashes that survive a restart, and "
                          f"prefix_caching_hash_algo={algo!r} seeds them randomly per process",
                          fix="use --prefix-caching-hash-algo sha256, or set PYTHONHASHSEED "
                              "to the same value for every engine")
    raise ConfigError(f"SpoolTier does not know whether prefix_caching_hash_algo={algo!r} "
                      "gives block hashes that survive a restart",
                      fix="use --prefix-caching-hash-algo sha256")
