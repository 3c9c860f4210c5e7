"""vLLM adapter for the spool tier's KV events (see ``events``): vLLM's event classes and
the identity of vLLM's block hash function. The only module that touches either.

Each announced chunk becomes one ``BlockStored`` with the hashes of its blocks
(``block_size`` tokens each, vLLM's hash granularity), the hash of the block before it as
``parent_block_hash``, ``medium="STORAGE"``, ``locality="LOCAL"`` (the rank-local disk of
the publishing replica, as vLLM's offloading tiers mean it) and ``ownership="spoolctl"``
(the tier that generated it); each withdrawn chunk one ``BlockRemoved`` with the same
hashes. ``token_ids`` is always empty and ``extra_keys`` unset: events never carry prompt
text, salts or media identifiers. Hashes go through vLLM's own
``maybe_convert_block_hash`` (64-bit integers under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
which NVIDIA Dynamo's router expects).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from vllm.distributed.kv_events import (
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from spoolctl.store import hash_parts

from ..planning.events import Removed, Stored

LOCALITY = "LOCAL"
OWNERSHIP = "spoolctl"
# vLLM's block hash functions that are not collision resistant: without PYTHONHASHSEED vLLM
# seeds them randomly per process, so their hashes differ after a restart.
_SEEDED_PER_PROCESS = ("xxhash", "xxhash_cbor")


def hash_identity(algo: str, hash_block_size: int) -> str | None:
    """A fingerprint of how this process computes block hashes (algorithm, seed, block
    size): hashes recorded under another fingerprint are not comparable. None until vLLM
    initialised its hash seed (the engine does so after building the scheduler)."""
    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    if not isinstance(none_hash, bytes) or not none_hash:
        return None
    # The seed enters only through a digest of vLLM's NONE_HASH: nothing secret is kept.
    return hash_parts(b"spoolctl-vllm-block-hash/v1", algo.encode(),
                      str(hash_block_size).encode(), bytes(none_hash))[:32]


def reproducible(algo: str) -> bool:
    """Whether block hashes survive a restart (so the startup inventory is meaningful)."""
    return algo not in _SEEDED_PER_PROCESS or os.environ.get("PYTHONHASHSEED") is not None


def to_vllm(records: Iterable[Stored | Removed], *, block_size: int, group_idx: int,
            spec_kind: str | None) -> list[KVCacheEvent]:
    """vLLM event objects for ``records`` (in order)."""
    out: list[KVCacheEvent] = []
    for rec in records:
        hashes = [maybe_convert_block_hash(kv_cache_utils.BlockHash(h))
                  for h in rec.hashes.blocks]
        if isinstance(rec, Stored):
            parent = rec.hashes.parent
            out.append(BlockStored(
                block_hashes=hashes,
                parent_block_hash=None if parent is None
                else maybe_convert_block_hash(kv_cache_utils.BlockHash(parent)),
                token_ids=[], block_size=block_size, lora_id=None, medium=MEDIUM_STORAGE,
                lora_name=None, extra_keys=None, group_idx=group_idx,
                kv_cache_spec_kind=spec_kind, kv_cache_spec_sliding_window=None,
                locality=LOCALITY, ownership=OWNERSHIP))
        else:
            out.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM_STORAGE,
                                    group_idx=group_idx, locality=LOCALITY,
                                    ownership=OWNERSHIP))
    return out
