"""Symlinks swapped in AFTER a store was opened (TOCTOU): for objects/, manifests/, tmp/,
quarantine/ and their fan-out directories. Each write gives one typed error (StoreIOError,
naming the swapped path), nothing is written outside the root, and a controller's prepare
still answers (from memory, cold) instead of failing."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from spoolctl.store import CorruptionError, QuarantineReason, Store, StoreIOError, entry_id_for
from spoolctl.store.format.digest import hash_bytes

DATA = b"hostile symlink payload " * 50


def _victim(store: Store, sub: str) -> Path:
    digest = hash_bytes(DATA)
    entry_id = entry_id_for("pytorch", "ns", "k")
    return {"objects": store.layout.objects, "objects/fan": store.layout.objects / digest[:2],
            "manifests": store.layout.manifests,
            "manifests/fan": store.layout.manifests / entry_id[:2],
            "tmp": store.layout.tmp, "quarantine": store.layout.quarantine}[sub]


def _swap(victim: Path, outside: Path) -> None:
    shutil.rmtree(victim)
    victim.symlink_to(outside, target_is_directory=True)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = Path(os.path.realpath(tmp_path)) / "outside"
    path.mkdir()
    return path


@pytest.mark.parametrize("sub", ["objects", "objects/fan", "manifests", "manifests/fan", "tmp"])
def test_commit_refuses_a_swapped_directory(store: Store, outside: Path, sub: str) -> None:
    store.put(kind="pytorch", namespace="ns", key="before", objects={"kv": b"x" * 10})
    _swap(_victim(store, sub), outside)
    with pytest.raises(StoreIOError, match="symbolic links") as info:
        store.put(kind="pytorch", namespace="ns", key="k", objects={"kv": DATA})
    assert "swapped for a symlink" in str(info.value)
    assert list(outside.iterdir()) == []
    assert store.lookup("pytorch", "ns", "k") is None  # nothing partial is visible
    assert [r.state for r in store.entries(include_pending=True)] == ["committed"]


def test_a_group_commit_checks_tmp_before_every_file(store: Store, outside: Path) -> None:
    """tmp/ swapped for a link while a batch is staging (here: by the first entry's stream
    ending): no later file of the batch is written through it (each is created after a
    check, then written through its descriptor), nothing becomes visible, and the error
    names the swap."""
    from spoolctl.store import PutRequest

    def swapping_stream():
        yield DATA
        _swap(store.layout.tmp, outside)

    outcomes = store.put_many([
        PutRequest("pytorch", "ns", "first", {"kv": swapping_stream()}),
        PutRequest("pytorch", "ns", "second", {"kv": DATA + b"2"}),
    ])
    assert [o.status for o in outcomes] == ["failed", "failed"]
    for o in outcomes:  # named as a swap, at tmp/, not as a missing file
        assert isinstance(o.error, StoreIOError) and o.error.errno == errno.ELOOP
        assert str(store.layout.tmp) in str(o.error)
    assert list(outside.iterdir()) == []
    assert store.entries(include_pending=True) == []


def test_quarantine_refuses_a_swapped_directory(store: Store, outside: Path) -> None:
    m = store.put(kind="pytorch", namespace="ns", key="k", objects={"kv": DATA})
    obj = store.layout.object_path(m.objects[0].digest)
    obj.write_bytes(b"Y" + obj.read_bytes()[1:])
    _swap(store.layout.quarantine, outside)
    with pytest.raises((StoreIOError, CorruptionError)):
        store.read(m, "kv")  # detected; the evidence is not moved through the link
    with pytest.raises(StoreIOError):
        store.quarantine_entry(m.entry_id, QuarantineReason.PAYLOAD_DIGEST, "test")
    assert list(outside.iterdir()) == []


def test_cli_reports_a_swapped_root_subdirectory_in_one_line(store: Store, outside: Path,
                                                            capsys) -> None:
    from spoolctl.cli.app import main

    store.put(kind="pytorch", namespace="ns", key="k", objects={"kv": DATA})
    store.close()
    _swap(store.layout.tmp, outside)
    with pytest.raises(SystemExit) as info:
        main(["clean", "--root", str(store.root), "--yes"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "symlink" in err
    assert list(outside.iterdir()) == []


def test_controller_prepare_survives_a_swap(tiny_model_dir: Path, store_root: Path,
                                            outside: Path) -> None:
    pytest.importorskip("transformers")
    from spoolctl.controllers import CachePrepareParams
    from spoolctl.controllers.pytorch import PyTorchCacheController

    params = CachePrepareParams(instructions=["Be brief."], data=["Doc. " * 8])
    with PyTorchCacheController(tiny_model_dir, str(store_root)) as ctl:
        cold = ctl.generate(params, "Q?", 4).tokens
        ctl.release(ctl.prepare(params).ref)
        ctl.store.clean_released()
        _swap(ctl.store.layout.objects, outside)
        handle = ctl.prepare(params)  # commit fails: served from memory, not raised
        assert handle.source == "cold" and ctl.stats()["commit_failures"] >= 1
        assert ctl.generate(params, "Q?", 4).tokens == cold
        os.unlink(ctl.store.layout.objects)  # restore a sane store for close()
        ctl.store.layout.objects.mkdir(mode=0o700)
    assert list(outside.iterdir()) == []
