"""``Store.lookup_many``: many keys with one catalog query, the same answers as ``lookup``,
and every object still verified when it is read (a bad one is quarantined and a miss)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spoolctl.store import CorruptionError, Store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)


def _put(store: Store, key: str, size: int = 20_000) -> bytes:
    data = os.urandom(size)
    store.put(kind="vllm", namespace="ns", key=key, objects={"kv": data})
    return data


def test_lookup_many_answers_like_lookup_in_order(store: Store) -> None:
    data = {k: _put(store, k) for k in ("a", "b", "c")}
    store.release(store.entry_id("vllm", "ns", "c"))  # released: no longer live
    found = store.lookup_many("vllm", "ns", ["c", "a", "zz", "b"], touch=False)
    assert [m.entry_id if m else None for m in found] == [
        None, store.entry_id("vllm", "ns", "a"), None, store.entry_id("vllm", "ns", "b")]
    assert [m is None for m in found] == [
        store.lookup("vllm", "ns", k, touch=False) is None for k in ("c", "a", "zz", "b")]
    for key, manifest in zip(("a", "b"), (found[1], found[3]), strict=True):
        assert manifest is not None and bytes(store.read(manifest, "kv")) == data[key]
    assert store.lookup_many("vllm", "ns", []) == []


def test_lookup_many_asks_the_catalog_once(store: Store) -> None:
    for k in ("a", "b", "c", "d"):
        _put(store, k)
    queries: list[str] = []
    store.catalog.connection_for_inspection().set_trace_callback(queries.append)
    try:
        found = store.lookup_many("vllm", "ns", ["a", "b", "c", "d"], touch=False)
    finally:
        store.catalog.connection_for_inspection().set_trace_callback(None)
    assert all(m is not None for m in found)
    assert len(queries) == 1, queries


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def test_a_bad_object_found_by_lookup_many_fails_its_read_is_quarantined_and_a_miss(
        store: Store) -> None:
    good = _put(store, "good")
    _put(store, "bad")
    manifests = store.lookup_many("vllm", "ns", ["good", "bad"], touch=False)
    assert manifests[0] is not None and manifests[1] is not None
    obj = store.layout.object_path(manifests[1].object("kv").digest)
    _flip(obj)
    into = memoryview(bytearray(manifests[1].object("kv").size))
    with pytest.raises(CorruptionError) as info:
        store.read(manifests[1], "kv", into=into)
    assert info.value.reason.value == "payload_digest"
    assert [i.reason for i in store.quarantine_items()] == ["payload_digest"]
    assert not obj.exists()
    assert [m is None for m in store.lookup_many("vllm", "ns", ["good", "bad"])] == [
        False, True]
    assert bytes(store.read(manifests[0], "kv")) == good


def test_lookup_many_touches_the_entries_it_found_at_once(store: Store) -> None:
    _put(store, "a")
    _put(store, "b")
    entry = store.entry_id("vllm", "ns", "a")
    before = store.row(entry)
    assert before is not None
    store.clock = lambda: before.last_access + 3600.0
    store.lookup_many("vllm", "ns", ["a", "missing"])
    after = store.row(entry)
    assert after is not None and after.last_access > before.last_access
