"""A restore's manifests loaded ahead of its objects: the same manifests and the same errors
as loading each on its read, and every object still verified when read."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from spoolctl.connector.worker_side.manifests import ManifestsAhead
from spoolctl.store import CorruptionError, ManifestError, Store

pytestmark = pytest.mark.base


def _put(store: Store, key: str) -> str:
    return store.put(kind="vllm", namespace="ns", key=key,
                     objects={"kv": os.urandom(4096)}).entry_id


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def test_manifests_ahead_give_the_same_manifests_and_errors(store: Store) -> None:
    good, bad = _put(store, "a"), _put(store, "b")
    _flip(store.layout.manifest_path(bad))
    with ThreadPoolExecutor(2) as pool:
        ahead = ManifestsAhead(store, pool, [good, bad, "0" * 64])
    assert ahead.take(good) == store.manifest(good)
    with pytest.raises(ManifestError):  # the load ahead quarantined it; the error is kept
        ahead.take(bad)
    assert len(store.quarantine_items()) == 1
    assert ahead.take(good) == store.manifest(good)  # taken once: then loaded on the read


def test_an_object_read_with_a_manifest_loaded_ahead_is_still_verified(store: Store) -> None:
    entry = _put(store, "a")
    with ThreadPoolExecutor(2) as pool:
        ahead = ManifestsAhead(store, pool, [entry])
    manifest = ahead.take(entry)
    _flip(store.layout.object_path(manifest.object("kv").digest))
    with pytest.raises(CorruptionError) as info:
        store.read(manifest, "kv")
    assert info.value.reason.value == "payload_digest"
    assert store.lookup("vllm", "ns", "a") is None
    assert [i.reason for i in store.quarantine_items()] == ["payload_digest"]
