"""Disk full and I/O errors: a real size-limited tmpfs for ENOSPC, and injected errors at
every durability step. The caller gets StoreIOError, nothing partial is visible, the store
stays consistent and usable once space is back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from testpaths import TESTS_DIR

from spoolctl.store import Store, StoreIOError
from spoolctl.store.disk.faults import COMMIT_CHECKPOINTS

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

WORKER = str(TESTS_DIR.joinpath("store_worker.py"))
# Every commit checkpoint up to the durable manifest (an error after the catalog commit has
# nothing left to undo).
FAIL_POINTS = [p for p in COMMIT_CHECKPOINTS if p != "catalog.committed"]


@pytest.fixture
def small_fs(mount_tmpfs):
    """A 4 MiB tmpfs for this test (see conftest.mount_tmpfs)."""
    return mount_tmpfs("4m")


def _check_consistent(store: Store) -> None:
    for row in store.entries(include_pending=True):
        assert row.state == "committed"
        m = store.manifest(row.entry_id)
        for ref in m.objects:
            store.read(m, ref.name)
    assert list(store.layout.tmp.iterdir()) == []


def test_enospc_on_a_real_full_filesystem(small_fs: Path) -> None:
    # Another tenant of the disk holds 1 MiB; the store fills the rest.
    filler = small_fs / "other-data.bin"
    filler.write_bytes(os.urandom(1 << 20))
    store = Store.open(small_fs / "store", create=True)
    committed = []
    with pytest.raises(StoreIOError) as info:
        for i in range(100):
            committed.append(store.put(kind="vllm", namespace="full", key=f"k{i}",
                                       objects={"kv": os.urandom(300_000)}))
    assert "No space left" in str(info.value) and "free disk space" in str(info.value)
    assert len(committed) >= 3
    for m in committed:  # nothing committed before the disk filled was lost
        hit = store.lookup("vllm", "full", m.key)
        assert hit is not None and len(store.read(hit, "kv")) == 300_000
    failed_key = f"k{len(committed)}"
    assert store.lookup("vllm", "full", failed_key) is None
    # the operator frees space; the store is consistent and usable again
    filler.unlink()
    store.collect_orphans(min_age=0)
    _check_consistent(store)
    store.release(committed[0].entry_id)
    assert store.clean_released().entries == 1
    # a new entry commits and reads back (the failed key itself may have been completed by
    # recovery, if the disk filled after its manifest was renamed: an entry is all or nothing)
    m = store.put(kind="vllm", namespace="full", key="after", objects={"kv": b"x" * 1000})
    assert bytes(store.read(m, "kv")) == b"x" * 1000
    hit = store.lookup("vllm", "full", failed_key)
    assert hit is None or len(store.read(hit, "kv")) == 300_000
    store.close()


@pytest.mark.parametrize("point", FAIL_POINTS)
@pytest.mark.parametrize("code", ["EIO", "ENOSPC"])
def test_injected_io_error_at_each_step(store_root: Path, point: str, code: str) -> None:
    Store.open(store_root, create=True).close()
    env = {**os.environ, "SPOOLCTL_FAIL_AT": f"{point}:{code}"}
    proc = subprocess.run([sys.executable, WORKER, str(store_root), "put", "victim", "20000"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "StoreIOError" in proc.stderr, proc.stderr
    with Store.open(store_root) as store:
        store.collect_orphans(min_age=0)
        _check_consistent(store)
        victim = store.lookup("pytorch", "crash", "victim")
        if point in ("manifest.published", "manifest.dir_fsynced"):
            # the manifest was already durable: recovery may keep the complete entry
            assert victim is None or bytes(store.read(victim, "a"))
        else:
            assert victim is None
            assert list(store.layout.objects.rglob("*.obj")) == []
    env.pop("SPOOLCTL_FAIL_AT")
    subprocess.run([sys.executable, WORKER, str(store_root), "put", "victim", "20000"],
                   env=env, check=True, timeout=120)
    with Store.open(store_root) as store:
        assert store.lookup("pytorch", "crash", "victim") is not None
