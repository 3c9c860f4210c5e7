"""Issue 15.3 and 15.11: special files never block, and no store file is reached through a
directory swapped for a symlink after open.

A FIFO in the place of any file the store opens (object, manifest, marker, catalog and its
-wal, scrub progress, request queue, lock, quarantine reason, owner record, temp file)
used to block the reader forever. Every open is now non-blocking and refuses non-regular
files; where the file is data, that is damage (quarantined, a finding, exit 1). Every
command runs as a real process with a timeout, so a hang fails the test instead of
hanging it."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from operator_cli import script

from spoolctl.store import Store, StoreIOError
from spoolctl.store.maintain.quarantine import REASON_FILE

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

HANG = 30  # seconds: far more than any of these commands needs


def _fresh(root: Path):
    with Store.open(root, create=True) as store:
        m = store.put(kind="pytorch", namespace="ns", key="k", objects={"kv": b"x" * 1000})
        store.put(kind="pytorch", namespace="ns", key="other", objects={"kv": b"y" * 1000})
    return m


def _fifo(path: Path) -> None:
    if os.path.lexists(path):
        os.unlink(path)
    os.mkfifo(path, 0o600)


def _sh(*argv: str) -> subprocess.CompletedProcess:
    proc = script(*argv, timeout=HANG)  # TimeoutExpired = a hang = a failed test
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def _py(code: str) -> subprocess.CompletedProcess:
    """Run store API code in a fresh process (a hang there must not hang the suite)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=HANG)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return Path(os.path.realpath(tmp_path)) / "store"


def test_fifo_object_is_quarantined_by_every_reader(root: Path) -> None:
    m = _fresh(root)
    obj = root / "objects" / m.objects[0].digest[:2] / f"{m.objects[0].digest}.obj"
    _fifo(obj)
    # the public API: lookup finds the entry, read refuses the FIFO (a miss), never blocks
    proc = _py(f"""
        from spoolctl.store import Store, CorruptionError
        with Store.open({str(root)!r}) as s:
            hit = s.lookup("pytorch", "ns", "k")
            try:
                s.read(hit, "kv")
            except CorruptionError as exc:
                print("miss", exc.reason.value)
            print(s.lookup("pytorch", "ns", "k"))
    """)
    assert proc.returncode == 0 and proc.stdout.split() == ["miss", "payload_missing", "None"], \
        proc.stderr
    items = json.loads(_sh("quarantine", "ls", "--root", str(root), "--json").stdout)["items"]
    assert [i["reason"] for i in items] == ["payload_missing"]
    assert "not a regular file (fifo)" in items[0]["detail"]
    assert not os.path.lexists(obj)  # the FIFO is evidence in the item now


@pytest.mark.parametrize("command", ["scrub", "request-auth", "inspect"])
def test_fifo_object_is_a_finding_for_each_command(root: Path, command: str) -> None:
    m = _fresh(root)
    _fifo(root / "objects" / m.objects[0].digest[:2] / f"{m.objects[0].digest}.obj")
    args = [command, "--root", str(root), "--json"]
    if command != "scrub":
        args.insert(1, m.entry_id)
    proc = _sh(*args)
    assert proc.returncode == 1, (command, proc.stdout, proc.stderr)
    if command == "scrub":
        doc = json.loads(proc.stdout)
        assert doc["quarantined"][0]["reason"] == "payload_missing" and doc["cycle_completed"]
        assert doc["checked"] == 1  # the other entry was verified after it


def test_fifo_manifest_marker_and_lock(root: Path) -> None:
    m = _fresh(root)
    _fifo(root / "manifests" / m.entry_id[:2] / f"{m.entry_id}.json")
    proc = _sh("inspect", m.entry_id, "--root", str(root))
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("error: invalid manifest") or \
        "not a regular file" in proc.stderr, proc.stderr
    items = json.loads(_sh("quarantine", "ls", "--root", str(root), "--json").stdout)["items"]
    assert [i["reason"] for i in items] == ["manifest_io"]

    _fifo(root / "state" / "maintenance.lock")
    proc = _sh("clean", "--root", str(root), "--yes")
    assert proc.returncode == 2 and "not a regular file" in proc.stderr, proc.stderr

    _fifo(root / ".spoolctl-root")
    for command in ("status", "doctor"):
        proc = _sh(command, "--root", str(root))
        assert proc.returncode in (1, 2) and "not a regular file (fifo)" in \
            (proc.stderr + proc.stdout), (command, proc.stdout, proc.stderr)


@pytest.mark.parametrize("name", ["catalog.sqlite3", "catalog.sqlite3-wal"])
def test_fifo_catalog_is_quarantined_and_rebuilt(root: Path, name: str) -> None:
    _fresh(root)
    _fifo(root / "state" / name)
    # a read command reports it and changes nothing; the next writing command rebuilds it
    proc = _sh("status", "--root", str(root), "--json")
    assert proc.returncode == 1 and "does not rebuild it" in proc.stderr, proc.stderr
    assert stat.S_ISFIFO(os.lstat(root / "state" / name).st_mode)
    assert _sh("scrub", "--root", str(root)).returncode == 0
    proc = _sh("status", "--root", str(root), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["entries"] == 2 and doc["quarantined"]["by_reason"] == {"catalog": 1}


def test_fifo_state_databases_queue_reason_owner_and_tmp(root: Path) -> None:
    m = _fresh(root)
    assert _sh("scrub", "--root", str(root)).returncode == 0
    _fifo(root / "state" / "scrub.sqlite3")
    proc = _sh("scrub", "--root", str(root), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["checked"] == 2, proc.stderr
    _fifo(root / "tmp" / f"{os.getpid() + 10_000_000}-{'0' * 16}.part")
    assert _sh("clean", "--root", str(root), "--yes", "--tmp", "--min-age", "0s"
               ).returncode == 0
    # the request queue, a quarantine reason and the owner record, through the API
    proc = _py(f"""
        import os
        from spoolctl.store import Store
        from spoolctl.store.maintain.auth_requests import AuthQueue
        with Store.open({str(root)!r}) as s:
            os.mkfifo(s.layout.state / "auth_requests.sqlite3")
            with AuthQueue.of(s) as q:
                print("queued", q.submit({m.entry_id!r}))
            lease = s.acquire_owner_lease("test")
            os.unlink(s.layout.state / "owner.json")
            os.mkfifo(s.layout.state / "owner.json")
            print("owner", s.owner().role)
            item = s.quarantine_items()[0]
            os.unlink(item.path / {REASON_FILE!r})
            os.mkfifo(item.path / {REASON_FILE!r})
            print("reason", s.quarantine_items()[0].reason)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["queued", "1", "owner", "unknown", "reason", "unknown"]
    doctor = json.loads(_sh("doctor", "--root", str(root), "--json").stdout)
    assert doctor["ok"] is False or doctor["checks"]


def test_doctor_names_special_files(root: Path) -> None:
    m = _fresh(root)
    _fifo(root / "objects" / m.objects[0].digest[:2] / f"{m.objects[0].digest}.obj")
    proc = _sh("doctor", "--root", str(root), "--json")
    assert proc.returncode == 1
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert checks["store.special_files"]["status"] == "fail"
    assert "(fifo)" in checks["store.special_files"]["detail"]


def test_state_swapped_for_a_symlink_after_open_puts_no_lock_outside(root: Path,
                                                                     tmp_path: Path) -> None:
    _fresh(root)
    elsewhere = Path(os.path.realpath(tmp_path)) / "elsewhere"
    elsewhere.mkdir()
    store = Store.open(root)
    try:
        shutil.move(root / "state", root / "state.real")
        (root / "state").symlink_to(elsewhere)
        with pytest.raises(StoreIOError, match="symlink"):
            store.clean_released()
        with pytest.raises(StoreIOError, match="symlink"):
            store.acquire_owner_lease("test")
        with pytest.raises(StoreIOError, match="symlink"):
            store.owner()
        assert list(elsewhere.iterdir()) == []
    finally:
        store.close()
