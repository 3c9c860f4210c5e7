"""Issue 15.8 and issue 22 (store side): as a non-root operator, unreadable parts are
findings, not crashes; a read-only store is readable; roots follow the owner rule from the
first open.

Root ignores mode bits, so every command here runs as an unprivileged user
(``tests/unprivileged.py`` drops to ``nobody`` after loading its modules) on a store that
user owns, and the files are prepared as root beforehand.

* An object with mode 000: reads miss with a StoreIOError, ``scrub`` records it as
  ``unreadable`` and completes its cycle (every run, never stuck on it), ``doctor`` names
  the file and the fix; nothing is moved.
* A fan-out directory with mode 000: ``clean`` cleans the rest, reports what it could not
  reach, and never takes the hidden entries for gone.
* A read-only catalog: read commands show the store read-only, write commands fail with one
  line, ``doctor`` reports the catalog as not writable.
* ``Store.open(..., read_only=True)`` on a store another user wrote and this user cannot
  write: lookups and verified reads work; nothing is created, locked or touched; every
  write is one ReadOnlyError line.
* As root, an empty directory owned by another user is refused (RootError) at the first
  open, as later opens refuse it.
"""

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
from testpaths import TESTS_DIR

from spoolctl.store import RootError, Store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

RUNNER = str(TESTS_DIR.joinpath("unprivileged.py"))
sys.path.insert(0, str(TESTS_DIR))
from owned_stores import owned_store, shared_dir  # noqa: E402
from unprivileged import unprivileged_uid  # noqa: E402

UID = unprivileged_uid()


def as_user(mode: str, *args: str) -> subprocess.CompletedProcess:
    """The CLI (``cli``) or a Python snippet (``py``) as the unprivileged user, through the
    one CLI runner (same environment as every other CLI test)."""
    return script(RUNNER, mode, *args, program=sys.executable, cwd="/tmp")


def cli(*args: str) -> subprocess.CompletedProcess:
    proc = as_user("cli", *args)
    assert "Traceback" not in proc.stderr and "unexpected" not in proc.stderr, proc.stderr
    return proc


def py(code: str) -> subprocess.CompletedProcess:
    return as_user("py", textwrap.dedent(code))


@pytest.fixture
def base():
    """A directory the unprivileged user can reach (pytest's tmp_path is root-only)."""
    yield from shared_dir("spool-unpriv-")


def _obj(root: Path, manifest) -> Path:
    d = manifest.objects[0].digest
    return root / "objects" / d[:2] / f"{d}.obj"


def test_an_unreadable_object_is_a_finding_and_the_scrub_moves_on(base: Path) -> None:
    root, made = owned_store(base, 3)
    _obj(root, made[1]).chmod(0)
    proc = py(f"""
        from spoolctl.store import Store, StoreIOError
        with Store.open({str(root)!r}) as s:
            try:
                s.read(s.manifest({made[1].entry_id!r}), "kv")
            except StoreIOError as exc:
                print("miss:", exc.message)
    """)
    assert proc.returncode == 0 and "miss: reading an object failed: Permission denied" in \
        proc.stdout, proc.stderr
    for _ in range(2):  # every run completes its cycle; none stops at the object
        scrub = cli("scrub", "--root", str(root), "--json")
        assert scrub.returncode == 1, scrub.stderr
        doc = json.loads(scrub.stdout)
        assert doc["cycle_completed"] and doc["checked"] == 2 and doc["quarantined"] == []
        assert [u["entry_id"] for u in doc["unreadable"]] == [made[1].entry_id]
    status = cli("status", "--root", str(root), "--json", "--check")
    assert status.returncode == 1 and json.loads(status.stdout)["scrub_unreadable"] == 1
    doctor = cli("doctor", "--root", str(root), "--json")
    assert doctor.returncode == 1
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["store.files"]["status"] == "fail"
    assert str(_obj(root, made[1])) in checks["store.files"]["detail"]
    assert "chmod 600" in checks["store.files"]["fix"]
    assert checks["scrub.unreadable"]["status"] == "fail"
    assert os.path.exists(_obj(root, made[1]))  # nothing moved: fixing the mode is enough
    assert cli("quarantine", "ls", "--root", str(root), "--json").stdout.count('"item"') == 0


def test_an_unreadable_fanout_directory_does_not_stop_clean(base: Path) -> None:
    root, made = owned_store(base, n=6, released=6)
    hidden = made[0]
    fan = root / "manifests" / hidden.entry_id[:2]
    fan.chmod(0)
    (root / "objects" / hidden.objects[0].digest[:2]).chmod(0)
    try:
        proc = cli("clean", "--yes", "--json", "--root", str(root))
        assert proc.returncode == 1, proc.stderr  # a finding, not a crash
        doc = json.loads(proc.stdout)
        assert doc["steps"]["released"]["entries"] == 5
        assert doc["failed"] >= 1 and not doc["errors"]
        assert str(fan) in doc["steps"]["orphans"]["unreadable"]
        assert doc["steps"]["orphans"]["dropped_rows"] == 0  # hidden is not "gone"
        doctor = json.loads(cli("doctor", "--root", str(root), "--json").stdout)
        dirs = {c["name"]: c for c in doctor["checks"]}["store.directories"]
        assert dirs["status"] == "fail" and str(fan) in dirs["detail"]
    finally:
        fan.chmod(0o700)
        (root / "objects" / hidden.objects[0].digest[:2]).chmod(0o700)
    with Store.open(root, allow_foreign_owner=True) as store:  # once fixed: whole
        assert store.row(hidden.entry_id).hint == "release"
        store.read_all(store.manifest(hidden.entry_id))


def test_a_read_only_catalog(base: Path) -> None:
    root, _made = owned_store(base, 3, released=1)
    (root / "state" / "catalog.sqlite3").chmod(0o400)
    status = cli("status", "--root", str(root), "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["read_only"] is True
    assert "read-only view" in status.stderr and status.stderr.count("\n") == 1
    assert cli("ls", "--root", str(root), "--json").returncode == 0
    clean = cli("clean", "--yes", "--root", str(root))
    assert clean.returncode == 2 and clean.stderr.count("\n") == 1, clean.stderr
    assert "cannot be written" in clean.stderr and "doctor" in clean.stderr
    doctor = json.loads(cli("doctor", "--root", str(root), "--json").stdout)
    check = {c["name"]: c for c in doctor["checks"]}["catalog.writable"]
    assert check["status"] == "fail" and "catalog.sqlite3" in check["detail"]


def test_an_immutable_catalog(base: Path) -> None:
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        pytest.skip("setting the immutable attribute needs root and chattr")
    root, _ = owned_store(base, 3)
    cat = root / "state" / "catalog.sqlite3"
    if subprocess.run(["chattr", "+i", str(cat)], capture_output=True).returncode != 0:
        pytest.skip("this filesystem does not support the immutable attribute")
    try:
        assert cli("status", "--root", str(root)).returncode == 0
        doctor = json.loads(cli("doctor", "--root", str(root), "--json").stdout)
        check = {c["name"]: c for c in doctor["checks"]}["catalog.writable"]
        assert check["status"] == "fail" and "immutable" in check["detail"]
    finally:
        subprocess.run(["chattr", "-i", str(cat)], check=False)


def _tree(root: Path) -> dict[str, tuple]:
    return {str(p.relative_to(root)): (p.stat(follow_symlinks=False).st_mtime_ns,
                                       p.stat(follow_symlinks=False).st_size)
            for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("owner_open", [False, True])
def test_read_only_open_of_a_store_another_user_wrote(base: Path, owner_open: bool) -> None:
    if os.geteuid() != 0:
        pytest.skip("a store owned by another user needs root to prepare")
    root = base / "store"
    store = Store.open(root, create=True)
    m = store.put(kind="pytorch", namespace="ns", key="k", objects={"kv": b"v" * 5000})
    store.put(kind="pytorch", namespace="ns", key="old", objects={"kv": b"o" * 100})
    if not owner_open:  # the owner's process exited: no -wal/-shm left
        store.close()
    for p in [root, *root.rglob("*")]:  # shared for reading, as a team cache would be
        p.chmod(0o755 if p.is_dir() else 0o644)
    before = _tree(root)
    proc = py(f"""
        from spoolctl.store import ReadOnlyError, Store
        with Store.open({str(root)!r}, read_only=True) as s:
            hit = s.lookup("pytorch", "ns", "k")
            print("read", len(s.read(hit, "kv")), s.facts().totals.entries)
            for what, call in (("put", lambda: s.put(kind="pytorch", namespace="ns",
                                                      key="new", objects={{"kv": b"x"}})),
                               ("release", lambda: s.release(hit.entry_id)),
                               ("clean", lambda: s.clean_released())):
                try:
                    call()
                except ReadOnlyError as exc:
                    print(what, "refused:", exc)
    """)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "read 5000 2"
    assert [line.split()[0] for line in lines[1:]] == ["put", "release", "clean"]
    assert all("opened read-only" in line for line in lines[1:])
    assert _tree(root) == before  # nothing created, locked, touched or rewritten
    if owner_open:
        store.close()
    assert m.entry_id


def test_the_owner_rule_holds_from_the_first_open(base: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("a directory owned by another user needs root to prepare")
    empty = base / "theirs"
    empty.mkdir()
    os.chown(empty, UID, UID)
    with pytest.raises(RootError, match="owned by uid"):
        Store.open(empty, create=True)
    assert os.listdir(empty) == []  # nothing seeded
    code = subprocess.run([str(Path(sys.executable).with_name("spoolctl")), "init", "--root",
                           str(empty)], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items()
                               if not k.startswith("SPOOLCTL_")})
    assert code.returncode == 2 and "--allow-foreign-owner" in code.stderr
    with Store.open(empty, create=True, allow_foreign_owner=True) as store:
        assert store.totals().entries == 0
    assert stat.S_ISDIR(os.lstat(empty / "objects").st_mode)


def test_clean_dry_run_plans_from_a_read_only_view(base: Path) -> None:
    """Issue 30.11: a dry run only reads, so it works where ls and status do. Before: it
    refused like a real clean ("cannot be written"), exit 2."""
    root, _made = owned_store(base, 3, released=1)
    (root / "state" / "catalog.sqlite3").chmod(0o400)
    proc = cli("clean", "--dry-run", "--json", "--root", str(root))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["dry_run"] is True and doc["steps"]["released"]["entries"] == 1
    assert "read-only view" in proc.stderr
    with Store.open(root, read_only=True) as store:  # nothing deleted
        assert len(store.entries()) == 3


OWNER, SHARED_GROUP = 4242, 4242  # a service account and its group (no passwd entry needed)


def _as(identity: str, *args: str) -> subprocess.CompletedProcess:
    proc = script(RUNNER, "cli", *args, program=sys.executable, cwd="/tmp",
                  env={"SPOOLCTL_TEST_AS": identity})
    assert "Traceback" not in proc.stderr and "unexpected" not in proc.stderr, proc.stderr
    return proc


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play two users")
def test_what_a_foreign_unprivileged_run_leaves_the_owner_can_use(base: Path) -> None:
    """An operator in the service account's group runs maintenance with
    --allow-foreign-owner (it cannot chown): what it creates is shared through the store's
    group, so the owner's own scrub and clean run on it afterwards."""
    root, made = owned_store(base, 4, released=1)
    for path in [root, *root.rglob("*")]:  # the service account's store, shared with its group
        os.lchown(path, OWNER, SHARED_GROUP)
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | (path.stat().st_mode & 0o700) >> 3)
    for name in ("scrub.sqlite3", "scrub.sqlite3-wal", "scrub.sqlite3-shm", "scrub.lock"):
        (root / "state" / name).unlink(missing_ok=True)
    _obj(root, made[1]).write_bytes(b"corrupt")  # the foreign scrub quarantines it
    operator = f"{UID}:{UID}:{SHARED_GROUP}"
    proc = _as(operator, "--allow-foreign-owner", "scrub", "--root", str(root))
    assert proc.returncode == 1, proc.stderr  # a finding: the corrupt object
    made_by_operator = [p for p in [root, *root.rglob("*")] if p.lstat().st_uid == UID]
    assert made_by_operator, "the foreign scrub created nothing: the test proves nothing"
    owner = f"{OWNER}:{SHARED_GROUP}"
    for args in (("scrub",), ("clean", "--released", "--yes"), ("quarantine", "ls")):
        proc = _as(owner, *args, "--root", str(root))
        assert proc.returncode in (0, 1), (args, proc.returncode, proc.stderr)
        assert "permission" not in (proc.stdout + proc.stderr).lower(), (args, proc.stdout,
                                                                         proc.stderr)
    doc = json.loads(_as(owner, "doctor", "--json", "--root", str(root)).stdout)
    unusable = [c for c in doc["checks"] if c["name"] == "store.files" and c["status"] != "ok"]
    assert not unusable, unusable
