"""Verify on every read: bit flips, truncation, missing files, swapped manifests, catalog loss."""

from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path

import pytest

from spoolctl.store import CorruptionError, ManifestError, Store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)


def _put(store: Store, key: str = "k", size: int = 20_000):
    data = os.urandom(size)
    return store.put(kind="pytorch", namespace="ns", key=key, objects={"kv": data}), data


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def _reasons(store: Store) -> list[str]:
    return [item.reason for item in store.quarantine_items()]


@pytest.mark.parametrize("offset", [0, 9_999, 19_999])
def test_bit_flip_in_object_is_detected_quarantined_and_a_miss(store: Store, offset: int) -> None:
    m, _data = _put(store)
    obj = store.layout.object_path(m.objects[0].digest)
    _flip(obj, offset)
    with pytest.raises(CorruptionError) as info:
        store.read(m, "kv")
    assert info.value.reason.value == "payload_digest"
    assert _reasons(store) == ["payload_digest"]
    assert store.lookup("pytorch", "ns", "k") is None
    assert not obj.exists() and not store.layout.manifest_path(m.entry_id).exists()
    item = store.quarantine_items()[0]
    assert item.entry_id == m.entry_id and item.kind == "pytorch"
    assert (item.path / obj.name).exists() and (item.path / f"{m.entry_id}.json").exists()
    # the key can be stored again and is healthy
    m2, data2 = _put(store)
    assert bytes(store.read(m2, "kv")) == data2


def test_truncated_object_is_a_size_failure(store: Store) -> None:
    m, _ = _put(store)
    obj = store.layout.object_path(m.objects[0].digest)
    with open(obj, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptionError) as info:
        store.read(m, "kv")
    assert info.value.reason.value == "payload_size"
    assert _reasons(store) == ["payload_size"]


def test_zero_filled_page_is_detected(store: Store) -> None:
    m, _ = _put(store, size=64 << 10)
    obj = store.layout.object_path(m.objects[0].digest)
    with open(obj, "r+b") as f:
        f.seek(4096)
        f.write(bytes(4096))
    with pytest.raises(CorruptionError):
        store.read(m, "kv")


def test_missing_object_quarantines_the_entry(store: Store) -> None:
    m, _ = _put(store)
    os.unlink(store.layout.object_path(m.objects[0].digest))
    with pytest.raises(CorruptionError) as info:
        store.read(m, "kv")
    assert info.value.reason.value == "payload_missing"
    assert store.lookup("pytorch", "ns", "k") is None


def test_symlink_swapped_in_for_an_object_is_never_followed(store: Store, tmp_path) -> None:
    m, _ = _put(store)
    obj = store.layout.object_path(m.objects[0].digest)
    outside = Path(os.path.realpath(tmp_path)) / "outside.bin"
    shutil.copy(obj, outside)  # identical bytes: following the link would "verify"
    os.unlink(obj)
    obj.symlink_to(outside)
    with pytest.raises(CorruptionError):
        store.read(m, "kv")
    assert outside.exists()


@pytest.mark.parametrize("offset", [5, 200, -3])
def test_bit_flip_in_manifest_is_detected(store: Store, offset: int) -> None:
    m, _ = _put(store)
    path = store.layout.manifest_path(m.entry_id)
    _flip(path, offset % path.stat().st_size)
    assert store.lookup("pytorch", "ns", "k") is None
    assert _reasons(store) == ["manifest_validation"]
    assert store.row(m.entry_id) is None


def test_manifest_swapped_onto_another_entry_is_rejected(store: Store) -> None:
    a, _ = _put(store, "a")
    b, _ = _put(store, "b")
    shutil.copy(store.layout.manifest_path(a.entry_id), store.layout.manifest_path(b.entry_id))
    with pytest.raises(ManifestError):
        store.manifest(b.entry_id)
    assert store.lookup("pytorch", "ns", "b") is None
    assert store.lookup("pytorch", "ns", "a") is not None


def test_catalog_deleted_is_rebuilt_from_manifests(store_root: Path) -> None:
    with Store.open(store_root, create=True) as store:
        _keep, data = _put(store, "keep")
        rel, _ = _put(store, "released")
        store.release(rel.entry_id)
    for suffix in ("", "-wal", "-shm"):
        p = store_root / "state" / f"catalog.sqlite3{suffix}"
        if p.exists():
            p.unlink()
    with Store.open(store_root) as store:
        hit = store.lookup("pytorch", "ns", "keep")
        assert hit is not None and bytes(store.read(hit, "kv")) == data
        # the release hint survives: a rebuild reads state/hints.log beside the manifests
        assert store.row(rel.entry_id).hint == "release"
        assert store.totals().entries == 2


def test_corrupt_catalog_is_quarantined_and_rebuilt(store_root: Path) -> None:
    with Store.open(store_root, create=True) as store:
        _, data = _put(store)
    catalog = store_root / "state" / "catalog.sqlite3"
    for suffix in ("-wal", "-shm"):
        Path(f"{catalog}{suffix}").unlink(missing_ok=True)
    catalog.write_bytes(b"garbage" * 1000)
    with Store.open(store_root) as store:
        hit = store.lookup("pytorch", "ns", "k")
        assert hit is not None and bytes(store.read(hit, "kv")) == data
        assert _reasons(store) == ["catalog"]


def test_catalog_corrupted_while_open_is_rebuilt_on_next_use(store_root: Path) -> None:
    store = Store.open(store_root, create=True)
    _m, data = _put(store)
    catalog = store_root / "state" / "catalog.sqlite3"
    # Drop the table behind the store's back: the next query fails as corruption.
    db = sqlite3.connect(catalog)
    db.execute("DROP TABLE entries")
    db.commit()
    db.close()
    hit = store.lookup("pytorch", "ns", "k")
    assert hit is not None and bytes(store.read(hit, "kv")) == data
    assert "catalog" in _reasons(store)
    store.close()


def test_restore_from_quarantine_only_when_it_verifies(store: Store) -> None:
    m, data = _put(store)
    obj = store.layout.object_path(m.objects[0].digest)
    _flip(obj, 10)
    with pytest.raises(CorruptionError):
        store.read(m, "kv")
    item = store.quarantine_items()[0]
    with pytest.raises(CorruptionError):
        store.restore_quarantined(item.item_id)
    assert store.lookup("pytorch", "ns", "k") is None
    _flip(item.path / obj.name, 10)  # the operator repaired the evidence
    restored = store.restore_quarantined(item.item_id)
    assert restored.entry_id == m.entry_id
    assert bytes(store.read(store.lookup("pytorch", "ns", "k"), "kv")) == data
    assert store.quarantine_items() == []
