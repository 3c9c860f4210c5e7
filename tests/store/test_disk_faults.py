"""A disk that fails or hangs (issue 32, decisions 2700 and 2701), on a real FUSE filesystem
the tests control (``tests/fusefs.py`` mounted over a store's ``manifests/`` or ``objects/``
by ``tests/fusemount.py``): an EIO is a miss and not a quarantine; a hung disk costs a
controller's ``prepare`` one deadline, then a cold run, and the store is used again once
the disk answers; the mount never leaves a test stuck."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
from fusemount import ControlledMount, Mounts
from waiting import wait_until

from spoolctl.store import Store, StoreIOError, entry_id_for

# What a test thread may wait for an operation that must not hang (the safety net: a
# broken deadline fails the test instead of wedging the suite; no result depends on it).
NET_S = 60


@pytest.fixture
def fuse(tmp_path: Path):
    """``fuse(directory)`` mounts ``tests/fusefs.py`` over ``directory`` for this test (see
    ``fusemount.Mounts``); every mount is taken down at teardown. Skips where FUSE cannot
    mount."""
    with Mounts(tmp_path / "fuse") as mounts:
        yield mounts.over


def _store(root: Path) -> Path:
    """A new store at ``root`` holding one entry (kind vllm, namespace ns, key a...a)."""
    with Store.open(root, create=True) as store:
        store.put(kind="vllm", namespace="ns", key="a" * 64, objects={"kv": b"x" * 1000})
    return root


@pytest.fixture
def eio_manifests(fuse, tmp_path: Path):
    """A store whose ``manifests/`` is a FUSE mount; yields (store, mount)."""
    root = _store(Path(os.path.realpath(tmp_path)) / "rank-0000")
    mount = fuse(root / "manifests")
    with Store.open(root) as store:
        yield store, mount


def test_an_eio_on_a_manifest_is_a_miss_not_a_quarantine(eio_manifests) -> None:
    store, mount = eio_manifests
    entry = entry_id_for("vllm", "ns", "a" * 64)
    mount.eio(".json")  # the disk fails every manifest read
    with pytest.raises(StoreIOError, match="Input/output error"):
        store.manifest(entry)
    assert store.live([entry]) == {entry}  # still in the catalog
    assert not list((Path(store.root) / "quarantine").iterdir())  # nothing quarantined
    mount.release()  # the disk reads again: so does the entry
    assert store.manifest(entry).entry_id == entry


def test_a_hung_mount_blocks_until_released_and_never_outlives_its_test(eio_manifests
                                                                        ) -> None:
    store, mount = eio_manifests
    entry = entry_id_for("vllm", "ns", "a" * 64)
    mount.hang()
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(store.manifest(entry).entry_id))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive() and not got  # held in the kernel, as on a hung mount
    mount.release()
    reader.join(NET_S)
    assert got == [entry]
    # A read still hung when the test ends is freed by the teardown, never left waiting.
    mount.hang()
    late: list[object] = []

    def read_late() -> None:
        try:
            late.append(store.manifest(entry).entry_id)
        except (OSError, StoreIOError) as exc:
            late.append(exc)

    reader = threading.Thread(target=read_late, daemon=True)
    reader.start()
    reader.join(0.2)
    mount.close()
    reader.join(NET_S)
    assert not reader.is_alive() and len(late) == 1


def test_the_connectors_probe_reads_an_object_so_a_hung_objects_disk_stays_out(
        fuse, tmp_path: Path) -> None:
    """The marker and the catalog answer (from the page cache, here: off the mount) while
    the objects' disk hangs: the probe must read an object too, or it brings the store
    back into service at once and every request waits out the deadline again (decision
    2720). Once the disk answers, the probe brings the store back."""
    from spoolctl.connector.diskguard import FAILURES_TO_DOWN, DiskGuard, probe

    root = _store(Path(os.path.realpath(tmp_path)) / "rank-0000")
    mount = fuse(root / "objects")
    with Store.open(root) as store:
        guard = DiskGuard(store, deadline_s=0.1, probe_interval_s=0.05)
        mount.hang()
        for _ in range(FAILURES_TO_DOWN):
            guard.failed()
        assert guard.down
        probing = threading.Thread(target=probe, args=(store,), daemon=True)
        probing.start()
        probing.join(0.5)
        assert probing.is_alive()  # held on the hung objects
        assert guard.down  # ten probe intervals later: its own probes are held too
        mount.release()
        probing.join(NET_S)
        assert not probing.is_alive()
        wait_until(lambda: not guard.down, NET_S, what="the store back in service")
        guard.close()


def test_scrub_on_eio_records_a_finding_and_doctor_explains_it(eio_manifests, fuse) -> None:
    """An object that fails with EIO is a scrub finding (``unreadable``), not a quarantine,
    and ``doctor`` says what it means and what to do (issue 32 item 2, decision 2720)."""
    from operator_cli import run_json

    store, _manifests = eio_manifests
    root = Path(store.root)
    fuse(root / "objects").eio(".obj")  # the disk fails every object read
    doc = run_json("scrub", "--root", str(root), "--json", expect=1)
    assert doc["quarantined"] == [] and len(doc["unreadable"]) == 1
    assert "Input/output error" in doc["unreadable"][0]["detail"]
    checks = {c["name"]: c for c in
              run_json("doctor", "--root", str(root), "--json", expect=1)["checks"]}
    assert checks["scrub.unreadable"]["status"] == "fail"
    assert "not proof of corruption" in checks["scrub.unreadable"]["fix"]
    assert not list((root / "quarantine").iterdir())


# -- the PyTorch controller on a hung disk ------------------------------------------------

QUESTION = "When does the pump start?"


def _params():
    from spoolctl.controllers import CachePrepareParams

    return CachePrepareParams(instructions=["Answer from the manual."],
                              data=["Manual: the pump starts when the tank is full. " * 6])


def _bounded(fn, *mounts: ControlledMount):
    """``fn()`` on a thread, its result; if it is still running after the safety net (a
    hang), the ``mounts`` are released (so nothing stays stuck on them) and the test fails."""
    out: list[object] = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(NET_S)
    if worker.is_alive():
        for mount in mounts:
            mount.release()
        worker.join(NET_S)
        raise AssertionError("the call hung on the disk until the disk was released")
    assert out, "the call raised (see the thread's traceback above)"
    return out[0]


def test_pytorch_prepare_on_a_hung_disk_is_one_deadline_then_a_cold_run(
        fuse, tiny_model_dir: Path, tmp_path: Path) -> None:
    from spoolctl.controllers.pytorch import PyTorchBackend, PyTorchCacheController

    backend = PyTorchBackend(tiny_model_dir)
    root = Path(os.path.realpath(tmp_path)) / "store"
    with PyTorchCacheController(backend, root) as ctl:  # the store holds the prompt
        stored = ctl.prepare(_params())
        cold = ctl.generate(_params(), QUESTION, 6).tokens
    assert stored.source == "cold" and stored.written_tokens > 0
    objects, manifests = fuse(root / "objects"), fuse(root / "manifests")
    # A running service whose disk hangs (opening a store on a hung disk hangs too).
    with PyTorchCacheController(backend, root, memory_entries=0,
                                lookup_deadline=0.2, read_deadline=0.5) as ctl:
        disk = (objects, manifests)
        objects.hang()
        manifests.hang()
        handle = _bounded(lambda: ctl.prepare(_params()), *disk)
        # The lookup missed its deadline: a miss, the cache prefilled cold and served
        # from memory, nothing written (the commit is not even tried on a hung disk).
        assert handle.source == "cold" and handle.written_tokens == 0
        assert ctl.stats()["disk_down"] >= 2  # the lookup, then the skipped commit
        assert _bounded(lambda: ctl.generate(handle, QUESTION, 6).tokens, *disk) == cold
        # While the disk stays hung, the next prepare does not wait on it at all.
        again = _bounded(lambda: ctl.prepare(_params()), *disk)
        assert again.source == "cold"
        objects.release()
        manifests.release()
        # The late lookup completes: the store is used again (a disk hit).
        wait_until(lambda: not ctl._deadlines.down, NET_S, what="the store back")
        hit = _bounded(lambda: ctl.prepare(_params()), *disk)
        assert hit.source == "disk"
        assert _bounded(lambda: ctl.generate(hit, QUESTION, 6).tokens) == cold
    assert not list((root / "quarantine").iterdir())


# -- the operator CLI on a hung disk ------------------------------------------------------
# A real process each (a hang is what is tested): the subprocess timeout is only the safety
# net; the assertions are on what the command says.

DEP = "vllm-v1-" + "a1" * 24
CLI_ENV = {"SPOOLCTL_DISK_TIMEOUT": "4"}  # far above a loaded CI host's healthy store


def _cli(mount: ControlledMount, *argv: str) -> subprocess.CompletedProcess:
    """``spoolctl ARGV`` in a real process (``operator_cli``'s environment). If it is still
    running after the safety net, the mount is released first (a process stuck on a hung
    FUSE request cannot even be killed) and the test fails."""
    from operator_cli import ENV, SPOOLCTL

    proc = subprocess.Popen([SPOOLCTL, *argv], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, **CLI_ENV})
    try:
        out, err = proc.communicate(timeout=NET_S)
    except subprocess.TimeoutExpired:
        mount.release()
        proc.kill()
        proc.communicate()
        raise AssertionError(f"spoolctl {' '.join(argv)} hung on the disk") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.fixture
def hung_rank(fuse, tmp_path: Path):
    """A base root with two rank stores; rank 1's ``objects/`` is a FUSE mount, hung.
    Yields (the base root, the mount)."""
    base = Path(os.path.realpath(tmp_path)) / "spool"
    for rank in (0, 1):
        _store(base / DEP / f"rank-{rank:04d}")
    mount = fuse(base / DEP / "rank-0001" / "objects")
    mount.hang()
    return base, mount


@pytest.fixture
def hung_drive(fuse, tmp_path: Path):
    """Two drive roots with a rank store each; the second drive is a FUSE mount, hung.
    Yields (the drive roots, the mount)."""
    here = Path(os.path.realpath(tmp_path))
    drives = [here / "nvme0" / "spool", here / "nvme1" / "spool"]
    for drive in drives:
        _store(drive / DEP / "rank-0000")
    mount = fuse(drives[1])
    mount.hang()
    return drives, mount


def test_status_on_a_hung_store_answers_and_reports_it_down(hung_rank) -> None:
    base, mount = hung_rank
    proc = _cli(mount, "status", "--root", str(base), "--json")
    rows = {s["rank"]: s for s in json.loads(proc.stdout)["stores"]}
    assert rows[0]["exit"] == 0 and "result" in rows[0]  # the healthy rank, as usual
    assert rows[1]["disk_down"] is True and "did not answer" in rows[1]["error"]
    assert proc.returncode == 2
    one = _cli(mount, "status", "--root", str(base / DEP / "rank-0001"), "--json")
    doc = json.loads(one.stdout)
    assert one.returncode == 2 and doc["disk_down"] is True
    assert doc["error"]["kind"] == "DiskNotAnsweringError"


def test_metrics_on_a_hung_store_answers_with_store_up_0(hung_rank, tmp_path: Path) -> None:
    base, mount = hung_rank
    prom = Path(os.path.realpath(tmp_path)) / "spoolctl.prom"
    proc = _cli(mount, "metrics", "--root", str(base), "--textfile", str(prom))
    text = prom.read_text()
    assert f'spoolctl_store_up{{deployment="{DEP}",rank="0000"}} 1.0' in text
    assert f'spoolctl_store_up{{deployment="{DEP}",rank="0001"}} 0.0' in text
    assert proc.returncode == 2 and "did not answer" in proc.stderr


@pytest.mark.extended  # a FUSE mount and a real process waiting out the disk timeout
def test_status_across_drives_with_one_hung_serves_the_others(hung_drive) -> None:
    """Several drive roots (decision 2712), one of them a hung mount: `status` answers
    within the disk timeout, the hung drive is its own `disk_down` row, the other drive is
    shown in full, exit 2 as for a store down. (It hung before: click's Path type stats
    every --root while parsing the command line, outside any deadline.)"""
    drives, mount = hung_drive
    proc = _cli(mount, "status", "--root", str(drives[0]), "--root", str(drives[1]), "--json")
    # the hung mount point alone: answered too (the command line no longer stats it)
    one = _cli(mount, "status", "--root", str(drives[1]), "--json")
    assert one.returncode == 2 and json.loads(one.stdout)["disk_down"] is True
    doc = json.loads(proc.stdout)
    served, hung = doc["drives"]
    assert served["exit"] == 0 and served["result"]["deployments"][DEP]["ranks"][0]["chunks"] == 1
    assert hung["disk_down"] is True and "did not answer" in hung["error"]
    assert doc["totals"]["drives_down"] == 1 and doc["totals"]["entries"] == 1
    assert proc.returncode == 2 and f"error: drive {drives[1]}:" in proc.stderr


@pytest.mark.extended  # a FUSE mount and a real process waiting out the disk timeout
def test_export_across_drives_with_one_hung_exports_the_others(hung_drive) -> None:
    """`export --root A --root B -o DIR` (decision 2713) with B a hung mount: B's scan does
    not answer within the disk timeout, so B is a `disk_down` row and no archive, A's
    archive is written whole, exit 2."""
    from spoolctl.cli.transfer_cmds import drive_archive_name

    drives, mount = hung_drive
    out = drives[0].parent.parent / "archives"
    out.mkdir()
    proc = _cli(mount, "export", "--root", str(drives[0]), "--root", str(drives[1]),
                "-o", str(out), "--json")
    doc = json.loads(proc.stdout)
    served, hung = doc["drives"]
    assert served["exit"] == 0 and served["result"]["entries"] == 1
    assert hung["disk_down"] is True and "did not answer" in hung["error"]
    assert [p.name for p in out.iterdir()] == [drive_archive_name(drives[0])]
    assert proc.returncode == 2 and f"error: drive {drives[1]}:" in proc.stderr
