"""Recovery and ownership: orphan age cutoff, unknown files, the owner lease."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spoolctl.store import Store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)


def test_young_orphans_are_kept_old_ones_reclaimed(store: Store) -> None:
    digest = "ab" * 32
    orphan = store.layout.object_path(digest)
    orphan.write_bytes(b"left by a crashed writer")
    report = store.collect_orphans(min_age=3600)
    assert orphan.exists() and report.young_orphans == 1
    old = time.time() - 7200
    os.utime(orphan, (old, old))
    dry = store.collect_orphans(min_age=3600, dry_run=True)
    assert orphan.exists() and dry.orphan_objects.objects == 1
    report = store.collect_orphans(min_age=3600)
    assert not orphan.exists() and report.orphan_objects.objects == 1


def test_referenced_objects_are_never_orphans(store: Store) -> None:
    m = store.put(kind="mlx", namespace="ns", key="k", objects={"a": b"live"})
    path = store.layout.object_path(m.objects[0].digest)
    old = time.time() - 7200
    os.utime(path, (old, old))
    store.collect_orphans(min_age=0)
    assert path.exists()
    assert bytes(store.read(m, "a")) == b"live"


def test_unindexed_manifest_is_indexed_before_orphans_are_collected(store: Store) -> None:
    m = store.put(kind="mlx", namespace="ns", key="k", objects={"a": b"live"})
    # simulate a catalog that lost the row (e.g. a power cut with synchronous=NORMAL)
    store.catalog.delete_entries([m.entry_id])
    report = store.collect_orphans(min_age=0)
    assert report.indexed == 1
    assert bytes(store.read(store.lookup("mlx", "ns", "k"), "a")) == b"live"


def test_unknown_files_in_fanout_dirs_are_reported_not_deleted(store: Store) -> None:
    stray = store.layout.objects / "00" / "notes.txt"
    stray.write_text("hello")
    report = store.collect_orphans(min_age=0)
    assert str(stray) in report.unknown_files and stray.exists()


def test_owner_lease_is_exclusive_and_dies_with_its_process(store_root: Path) -> None:
    Store.open(store_root, create=True).close()
    code = (
        "import sys, time\n"
        "from spoolctl.store import Store\n"
        f"s = Store.open({str(store_root)!r})\n"
        "lease = s.acquire_owner_lease('vllm-worker')\n"
        "print('held' if lease else 'busy', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with Store.open(store_root) as store:
            owner = store.owner()
            assert owner is not None and owner.pid == proc.pid and owner.role == "vllm-worker"
            assert store.acquire_owner_lease("cli") is None
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            assert store.owner() is None
            lease = store.acquire_owner_lease("cli")
            assert lease is not None
            lease.release()
    finally:
        proc.kill()


def test_clean_tmp_never_removes_a_live_writers_file(store: Store) -> None:
    live = store.layout.tmp / f"{os.getpid()}-{'a' * 16}.part"
    live.write_bytes(b"in flight")
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout.strip()
    dead = store.layout.tmp / f"{dead_pid}-{'b' * 16}.part"
    dead.write_bytes(b"abandoned")
    report = store.clean_tmp(min_age=0)
    assert live.exists() and not dead.exists() and report.files == 1
    old = time.time() - 7200
    os.utime(live, (old, old))
    store.clean_tmp(min_age=0)
    assert not live.exists()
