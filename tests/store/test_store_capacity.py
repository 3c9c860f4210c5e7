"""Bounded capacity: released first, then least recently used, down to 90%; shared
objects kept; an entry too large to fit is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from waiting import StepClock

from spoolctl.store import CapacityError, Store
from spoolctl.store.catalog import writes as catalog_mod

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)


@pytest.fixture(autouse=True)
def _touch_always(monkeypatch: pytest.MonkeyPatch) -> None:
    # The LRU clock normally moves at most every 30 s; tests need it to move now.
    monkeypatch.setattr(catalog_mod, "TOUCH_GRANULARITY", 0.0)


def _put(store: Store, key: str, size: int = 10_000, shared: bytes | None = None):
    objects = {"a": os.urandom(size)}
    if shared is not None:
        objects["s"] = shared
    m = store.put(kind="vllm", namespace="cap", key=key, objects=objects)
    return m


def test_eviction_order_released_then_lru_down_to_low_watermark(store_root: Path) -> None:
    with Store.open(store_root, create=True, clock=StepClock()) as store:
        entries = {k: _put(store, k) for k in ("e0", "e1", "e2", "e3", "e4", "e5")}
        assert store.lookup("vllm", "cap", "e0") is not None  # e0 becomes most recent
        store.release(entries["e4"].entry_id)
        size = store.totals().bytes
        store.set_max_bytes(int(size * 0.75))
        report = store.enforce_capacity()
        left = {r.key for r in store.entries()}
        # 6 equal entries, cap 75%, low watermark 67.5%: two must go. e4 (released)
        # goes first, then e1 (least recently used): e0 was touched by the lookup.
        assert left == {"e0", "e2", "e3", "e5"}
        assert store.totals().bytes <= int(size * 0.75 * 0.9)
        assert report.entries == 6 - len(left)
        # What it freed, manifests (sizes from the catalog) and objects alike.
        assert report.bytes == size - store.totals().bytes


def test_shared_objects_of_live_entries_are_kept(store_root: Path) -> None:
    shared = os.urandom(20_000)
    with Store.open(store_root, create=True, clock=StepClock()) as store:
        old = _put(store, "old", shared=shared)
        new = _put(store, "new", shared=shared)
        store.set_max_bytes(store.totals().bytes - 1)
        store.enforce_capacity()
        assert store.lookup("vllm", "cap", "old") is None
        hit = store.lookup("vllm", "cap", "new")
        assert bytes(store.read(hit, "s")) == shared
        assert store.layout.object_path(new.object("s").digest).exists()
        assert not store.layout.object_path(old.object("a").digest).exists()


def test_commits_keep_the_store_bounded(store_root: Path) -> None:
    with Store.open(store_root, create=True, clock=StepClock(), max_bytes=200_000) as store:
        for i in range(40):
            _put(store, f"k{i}", size=20_000)
            assert store.totals().bytes <= 200_000
        assert store.lookup("vllm", "cap", "k39") is not None
        assert store.lookup("vllm", "cap", "k0") is None


def test_entry_larger_than_the_store_is_refused(store_root: Path) -> None:
    with Store.open(store_root, create=True, clock=StepClock(), max_bytes=50_000) as store:
        with pytest.raises(CapacityError, match="max size"):
            _put(store, "huge", size=60_000)
        assert store.totals().entries == 0
        store.collect_orphans(min_age=0)
        assert list(store.layout.objects.rglob("*.obj")) == []


def test_dry_run_changes_nothing(store_root: Path) -> None:
    with Store.open(store_root, create=True, clock=StepClock()) as store:
        for i in range(4):
            _put(store, f"k{i}")
        store.set_max_bytes(store.totals().bytes // 2)
        before = store.totals()
        plan = store.enforce_capacity(dry_run=True)
        assert plan.entries >= 2 and store.totals() == before


def _disk_bytes(root: Path) -> int:
    """Bytes the store takes on disk (allocated blocks of every file and directory: du)."""
    total = os.lstat(root).st_blocks * 512
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def test_disk_overhead_is_what_the_docs_say(store_root: Path) -> None:
    """docs/connector.md "What the max size counts" (issue 36.9): a full store takes at most
    max size + 4 MiB + 4 KiB per entry on disk (fan-out directories, reserve, catalog, block
    rounding), and the max size bounds the catalog's bytes."""
    with Store.open(store_root, create=True, max_bytes=4 << 20) as store:
        for i in range(24):
            store.put(kind="vllm", namespace="ns", key=f"{i:064x}",
                      objects={"kv": os.urandom(256 << 10)})
        totals = store.totals()
    assert totals.bytes <= 4 << 20 and totals.entries >= 10
    assert _disk_bytes(store_root) <= (4 << 20) + (4 << 20) + totals.entries * 4096
