"""Crash at every durability checkpoint (a real subprocess dies with os._exit there),
then reopen: the entry is complete or absent, nothing partial is visible, no committed
entry is lost, and cleanup reclaims the leftovers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from faultseam import CRASH_EXIT_CODE
from testpaths import TESTS_DIR

from spoolctl.store import Store
from spoolctl.store.disk.faults import COMMIT_CHECKPOINTS

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

WORKER = str(TESTS_DIR.joinpath("store_worker.py"))
# Every commit checkpoint the store has (a new one is crash-tested without editing this).
COMMIT_POINTS = list(COMMIT_CHECKPOINTS)
# Before the manifest is renamed into place nothing of the entry may be visible after a crash.
INVISIBLE_POINTS = ("catalog.intent", "manifest.tmp_written", "manifest.fsynced")


def run_worker(root: Path, *args: str, crash_at: str | None = None) -> int:
    env = dict(os.environ)
    env.pop("SPOOLCTL_CRASH_AT", None)
    if crash_at:
        env["SPOOLCTL_CRASH_AT"] = crash_at
    proc = subprocess.run([sys.executable, WORKER, str(root), *args], env=env,
                          capture_output=True, text=True, timeout=120)
    if proc.returncode not in (0, CRASH_EXIT_CODE):
        raise AssertionError(proc.stderr)
    return proc.returncode


def expected(key: str, size: int) -> dict[str, bytes]:
    sys.path.insert(0, str(Path(WORKER).parent))
    from store_worker import payload

    return {"a": payload(key, size), "b": payload(key + "b", size // 2 + 1)}


def assert_consistent(store: Store) -> None:
    """Every catalog-visible entry is complete and verifies; no pending rows linger."""
    for row in store.entries(include_pending=True):
        assert row.state == "committed", row
        manifest = store.manifest(row.entry_id)
        for ref in manifest.objects:
            store.read(manifest, ref.name)


def assert_reclaimable(store: Store) -> None:
    store.clean_tmp(min_age=0)
    store.collect_orphans(min_age=0)
    assert list(store.layout.tmp.iterdir()) == []
    referenced = {ref.digest for row in store.entries()
                  for ref in store.manifest(row.entry_id).objects}
    on_disk = {p.name[:-4] for p in store.layout.objects.rglob("*.obj")}
    assert on_disk == referenced


@pytest.mark.parametrize("point", COMMIT_POINTS)
def test_crash_during_commit(store_root: Path, point: str) -> None:
    assert run_worker(store_root, "put", "survivor", "30000") == 0
    code = run_worker(store_root, "put", "victim", "30000", crash_at=point)
    assert code == CRASH_EXIT_CODE, f"worker did not reach checkpoint {point}"
    with Store.open(store_root) as store:
        # opening removed the dead writer's temp files (named after its pid)
        assert list(store.layout.tmp.iterdir()) == []
        assert_consistent(store)
        survivor = store.lookup("pytorch", "crash", "survivor")
        assert survivor is not None, "a committed entry was lost"
        victim = store.lookup("pytorch", "crash", "victim")
        if victim is not None:  # complete: every byte must be right
            want = expected("victim", 30000)
            assert {n: bytes(store.read(victim, n)) for n in want} == want
        # A crash after the manifest is durable must keep the entry.
        if point in ("manifest.published", "manifest.dir_fsynced", "catalog.committed"):
            assert victim is not None
        if point.startswith("object.") or point in INVISIBLE_POINTS:
            assert victim is None
        assert_reclaimable(store)
        assert store.lookup("pytorch", "crash", "survivor") is not None
    # and the interrupted key can be committed afterwards
    assert run_worker(store_root, "put", "victim", "30000") == 0
    with Store.open(store_root) as store:
        assert store.lookup("pytorch", "crash", "victim") is not None


@pytest.mark.parametrize("point", ["clean.manifest_deleted", "clean.catalog_deleted",
                                   "clean.object_deleted"])
def test_crash_during_clean(store_root: Path, point: str) -> None:
    run_worker(store_root, "put", "keep", "20000")
    run_worker(store_root, "put", "drop", "20000")
    assert run_worker(store_root, "release-clean", "drop", crash_at=point) == CRASH_EXIT_CODE
    with Store.open(store_root) as store:
        assert store.lookup("pytorch", "crash", "drop") is None  # never visible again
        assert store.lookup("pytorch", "crash", "keep") is not None
        store.clean_released()
        store.collect_orphans(min_age=0)
        assert_consistent(store)
        assert_reclaimable(store)
        assert [r.key for r in store.entries()] == ["keep"]


@pytest.mark.parametrize("point", ["evict.manifest_deleted", "evict.catalog_deleted",
                                   "evict.object_deleted"])
def test_crash_during_capacity_eviction(store_root: Path, point: str) -> None:
    for key in ("old", "mid", "new"):
        run_worker(store_root, "put", key, "40000")
    max_bytes = 130_000  # three entries of ~61 KB: must evict down to 117 KB
    assert run_worker(store_root, "evict", str(max_bytes), crash_at=point) == CRASH_EXIT_CODE
    with Store.open(store_root) as store:
        assert store.lookup("pytorch", "crash", "new") is not None
        store.enforce_capacity()
        store.collect_orphans(min_age=0)
        assert_consistent(store)
        assert_reclaimable(store)
        assert store.totals().bytes <= max_bytes
        assert store.lookup("pytorch", "crash", "old") is None


@pytest.mark.parametrize("point", ["quarantine.catalog_deleted", "quarantine.moved"])
def test_crash_during_quarantine(store_root: Path, point: str) -> None:
    run_worker(store_root, "put", "bad", "20000")
    with Store.open(store_root) as store:
        m = store.lookup("pytorch", "crash", "bad")
        obj = store.layout.object_path(m.object("a").digest)
        raw = bytearray(obj.read_bytes())
        raw[7] ^= 0x40
        obj.write_bytes(bytes(raw))
    assert run_worker(store_root, "read", "bad", crash_at=point) == CRASH_EXIT_CODE
    with Store.open(store_root) as store:
        store.collect_orphans(min_age=0)
        hit = store.lookup("pytorch", "crash", "bad")
        if hit is not None:
            # the interrupted quarantine left the entry findable: the next read catches it
            with pytest.raises(Exception, match="digest"):
                store.read(hit, "a")
        assert store.lookup("pytorch", "crash", "bad") is None
        assert any(i.entry_id == m.entry_id for i in store.quarantine_items())


# -- group commit: a crash at every checkpoint of a batch ------------------------------------------

BATCH = 8
# Checkpoints passed once per batch: crash at their only pass. The others are passed once per
# object, manifest or directory: crash at the first and at the third pass (mid-step).
ONCE = ("catalog.intent", "catalog.committed")
BATCH_POINTS = [f"{p}:{n}" for p in COMMIT_POINTS for n in ((1,) if p in ONCE else (1, 3))]


def batch_expected(i: int, size: int) -> dict[str, bytes]:
    sys.path.insert(0, str(Path(WORKER).parent))
    from store_worker import batch_objects

    return batch_objects("v", i, size)


@pytest.mark.parametrize("point", BATCH_POINTS)
def test_crash_during_group_commit(store_root: Path, point: str) -> None:
    """Each entry of the batch is whole or absent; entries are visible exactly when their
    manifest was renamed before the crash; no committed entry is lost; the entry that failed
    while streaming is never visible; the leftovers are reclaimed."""
    assert run_worker(store_root, "put", "survivor", "30000") == 0
    code = run_worker(store_root, "put-batch", "v", str(BATCH), "20000", crash_at=point)
    assert code == CRASH_EXIT_CODE, f"worker did not reach checkpoint {point}"
    name, _, nth = point.partition(":")
    with Store.open(store_root) as store:
        assert list(store.layout.tmp.iterdir()) == []
        assert_consistent(store)  # no pending rows; every visible entry verifies
        assert store.lookup("pytorch", "crash", "survivor") is not None
        assert store.lookup("pytorch", "crash", "v-bad") is None
        visible = []
        for i in range(BATCH):
            hit = store.lookup("pytorch", "crash", f"v-{i}")
            if hit is not None:
                want = batch_expected(i, 20000)
                assert {n: bytes(store.read(hit, n)) for n in want} == want
                visible.append(i)
        if name == "manifest.published":  # renamed in order, crash after the n-th rename
            assert visible == list(range(int(nth)))
        elif name in ("manifest.dir_fsynced", "catalog.committed"):
            assert visible == list(range(BATCH))
        else:
            assert visible == []
        assert_reclaimable(store)
    # the batch can be committed afterwards
    assert run_worker(store_root, "put-batch", "v", str(BATCH), "20000") == 0
    with Store.open(store_root) as store:
        assert all(store.lookup("pytorch", "crash", f"v-{i}") for i in range(BATCH))
        assert store.lookup("pytorch", "crash", "v-bad") is None
