"""Disk full and I/O errors under a controller: ENOSPC on a real, small tmpfs and EIO/ENOSPC
injected at each store step during a PyTorch ``prepare``. The request never fails: the
cache is served from memory with the same greedy tokens, the failure is counted, nothing
partial is visible, and once the disk is healthy the next prepare commits."""

from __future__ import annotations

import os
from pathlib import Path

import faultseam
import pytest

from spoolctl.store import Store

pytest.importorskip("transformers")

# Each step once, alternating the two errors (the store-level test crosses all of them).
CASES = [("object.tmp_written", "ENOSPC"), ("object.fsynced", "EIO"),
         ("object.published", "ENOSPC"), ("catalog.intent", "EIO"),
         ("manifest.tmp_written", "ENOSPC"), ("manifest.published", "EIO")]
QUESTION = "When does the pump start?"


def _params(n: int = 1):
    from spoolctl.controllers import CachePrepareParams

    return CachePrepareParams(instructions=["Answer from the manual."],
                              data=[f"Manual {n}: the pump starts when the tank is full. " * 6])


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path):
    from spoolctl.controllers.pytorch import PyTorchBackend

    return PyTorchBackend(tiny_model_dir)


@pytest.fixture(scope="module")
def cold(backend):
    from spoolctl.controllers.pytorch import PyTorchCacheController

    with PyTorchCacheController(backend, None) as ctl:
        return ctl.generate(_params(), QUESTION, 6).tokens


def _consistent(root: Path) -> None:
    with Store.open(root) as store:
        for row in store.entries(include_pending=True):
            assert row.state == "committed"
            m = store.manifest(row.entry_id)
            store.read_all(m)
        store.collect_orphans(min_age=0)
        assert list(store.layout.tmp.iterdir()) == []


@pytest.mark.parametrize(("point", "code"), CASES)
def test_injected_error_during_prepare(backend, cold, store_root: Path,
                                       point: str, code: str) -> None:
    from spoolctl.controllers.pytorch import PyTorchCacheController

    faultseam.install(fail_at=f"{point}:{code}")
    try:
        with PyTorchCacheController(backend, str(store_root)) as ctl:
            handle = ctl.prepare(_params())
            assert handle.source == "cold" and ctl.stats()["commit_failures"] == 1
            assert ctl.generate(_params(), QUESTION, 6).tokens == cold
    finally:
        faultseam.uninstall()
    _consistent(store_root)
    with Store.open(store_root) as store:
        assert store.entries() == [] or point == "manifest.published"
    with PyTorchCacheController(backend, str(store_root)) as ctl:
        assert ctl.prepare(_params()).source in ("cold", "disk")
    with PyTorchCacheController(backend, str(store_root)) as ctl:
        assert ctl.prepare(_params()).source == "disk"
        assert ctl.generate(_params(), QUESTION, 6).tokens == cold


@pytest.fixture
def small_fs(mount_tmpfs):
    """A 1 MiB tmpfs for this test (see conftest.mount_tmpfs)."""
    return mount_tmpfs("1m")


def test_real_full_filesystem_under_a_controller(backend, small_fs: Path) -> None:
    from spoolctl.controllers.pytorch import PyTorchCacheController

    root = small_fs / "store"
    with PyTorchCacheController(backend, str(root)) as ctl:
        assert ctl.prepare(_params(0)).source == "cold"  # fits
    filler = small_fs / "other-tenant.bin"
    # The disk fills while the controller runs (opening a store on a 100% full disk is a
    # StoreIOError at construction: SQLite cannot create its WAL files).
    with PyTorchCacheController(backend, str(root)) as ctl:
        free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
        filler.write_bytes(b"\0" * max(free - 4096, 0))
        tokens = {}
        for n in (1, 2, 3):
            handle = ctl.prepare(_params(n))  # never raises on a full disk
            assert handle.source in ("cold", "incremental")  # computed, not read
            tokens[n] = ctl.generate(_params(n), QUESTION, 4).tokens
        assert ctl.stats()["commit_failures"] >= 1
    filler.unlink()
    _consistent(root)
    with PyTorchCacheController(backend, str(root)) as ctl:
        assert ctl.prepare(_params(0)).source == "disk"  # committed before: not lost
        for n in (1, 2, 3):
            ctl.prepare(_params(n))
            assert ctl.generate(_params(n), QUESTION, 4).tokens == tokens[n]
    with PyTorchCacheController(backend, None) as ctl:  # and those tokens are right
        assert all(ctl.generate(_params(n), QUESTION, 4).tokens == tokens[n] for n in (1, 2, 3))
