"""Rollbacks: a real previous build of spoolctl and this one on the same store, both ways.

The previous build is this repository at ``PREVIOUS`` (the last commit before the hint
log), exported with ``git archive`` and run with the current interpreter's dependencies
(``PYTHONPATH`` at the exported tree), once per session. It cannot be changed, so what is
tested of it is what it already does: it refuses a marker that requires a feature it does
not know, and this build's stores require ``hints-log``.

* The previous build on a store this one wrote refuses every command (exit 2, the feature
  named) and changes no file: no catalog quarantined and rebuilt, no release lost.
* This build on a store the previous one wrote: read commands (``status``, ``ls``,
  ``doctor``) change no file; the first write upgrades it (the hint log written from the
  catalog, then the marker); a crash at either step leaves a store both builds still open
  and the next write finishes it; from then on a catalog rebuild keeps every release.
* A catalog of a newer schema is refused, never quarantined; an older one is read as it is
  by read commands.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from faultseam import CRASH_EXIT_CODE
from operator_cli import ENV, run
from testpaths import REPO_DIR

from spoolctl.errors import CorruptionError
from spoolctl.store import Store, entry_id_for
from spoolctl.store.catalog.schema import DDL_V1

pytestmark = pytest.mark.base

# main before the hint log: what a canary rolled back to runs.
PREVIOUS = "494e8e6253af7ae7c011a46628020c86ad46093a"
REPO = REPO_DIR
_PUT = """
import sys
from spoolctl.errors import CorruptionError
from spoolctl.store import Store, entry_id_for
with Store.open(sys.argv[1], create=True) as s:
    for i in range(int(sys.argv[2])):
        s.put(kind="mlx", namespace="ns", key=f"k{i}", objects={"o": b"%d" % i * 300})
    for key in sys.argv[3:]:
        assert s.release(entry_id_for("mlx", "ns", key))
"""


@pytest.fixture(scope="session")
def previous_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``spoolctl`` package of ``PREVIOUS``, exported once per session."""
    if shutil.which("git") is None or subprocess.run(
            ["git", "-C", str(REPO), "cat-file", "-e", f"{PREVIOUS}^{{commit}}"],
            capture_output=True).returncode != 0:
        pytest.skip(f"needs this repository's history (commit {PREVIOUS[:12]})")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", PREVIOUS, "spoolctl"],
                             capture_output=True, check=True, timeout=120).stdout
    out = tmp_path_factory.mktemp("previous-build")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(out, filter="data")
    where = _previous(out, "-c", "import spoolctl; print(spoolctl.__file__)", module=False)
    assert where.stdout.strip() == str(out / "spoolctl" / "__init__.py"), where
    return out


def _previous(build: Path, *argv: str, module: bool = True) -> subprocess.CompletedProcess:
    """The previous build (``python -m spoolctl ARGV``, or ``python ARGV``)."""
    return subprocess.run([sys.executable, *(("-m", "spoolctl") if module else ()), *argv],
                          env={**ENV, "PYTHONPATH": str(build)}, capture_output=True,
                          text=True, timeout=300, cwd=build)  # not this checkout's package


def _snapshot(root: Path) -> dict[str, str]:
    """Every file and directory under ``root``: its content's digest and mode."""
    found = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath, name)
            st = path.lstat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "d"
            found[str(path.relative_to(root))] = f"{digest} {st.st_mode:o}"
    return found


_EMPTY = hashlib.sha256(b"").hexdigest()


def _assert_unchanged(root: Path, before: dict[str, str], what: object) -> None:
    """Every file as it was. SQLite's read-only open of a WAL database may add an empty
    ``-wal`` and its ``-shm`` index (no data: its own bookkeeping), nothing else."""
    after = _snapshot(root)
    assert {k: after.get(k) for k in before} == before, what
    added = {k: after[k] for k in after.keys() - before.keys()}
    assert set(added) <= {"state/catalog.sqlite3-wal", "state/catalog.sqlite3-shm"}, what
    assert added.get("state/catalog.sqlite3-wal", _EMPTY).split()[0] == _EMPTY, what


def _marker(root: Path) -> dict:
    return json.loads((root / ".spoolctl-root").read_text())


def _ids(*keys: str) -> list[str]:
    return [entry_id_for("mlx", "ns", k) for k in keys]


def _drop_catalog(root: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        (root / "state" / f"catalog.sqlite3{suffix}").unlink(missing_ok=True)


def test_the_previous_build_refuses_a_store_this_one_wrote(previous_build: Path,
                                                           store_root: Path) -> None:
    with Store.open(store_root, create=True) as s:
        for i in range(3):
            s.put(kind="mlx", namespace="ns", key=f"k{i}", objects={"o": b"x" * 300})
        assert s.release(_ids("k1")[0])
    assert "hints-log" in _marker(store_root)["requires"]
    before = _snapshot(store_root)
    for argv in (["status"], ["ls"], ["inspect", _ids("k2")[0]], ["clean", "--released", "--yes"],
                 ["scrub"], ["init"]):
        proc = _previous(previous_build, *argv, "--root", str(store_root))
        assert proc.returncode == 2, (argv, proc.stdout, proc.stderr)
        assert "hints-log" in proc.stderr and "newer version" in proc.stderr, proc.stderr
    proc = _previous(previous_build, "doctor", "--root", str(store_root))  # a finding
    assert proc.returncode == 1 and "hints-log" in proc.stdout, proc.stdout
    assert _snapshot(store_root) == before
    with Store.open(store_root) as s:
        assert s.released()[0] == 1


def test_this_build_reads_a_previous_store_unchanged_and_upgrades_it_on_first_write(
        previous_build: Path, store_root: Path) -> None:
    proc = _previous(previous_build, "-c", _PUT, str(store_root), "4", "k1", module=False)
    assert proc.returncode == 0, proc.stderr
    assert "requires" not in _marker(store_root)
    before = _snapshot(store_root)
    for argv in (["status", "--json"], ["ls"], ["doctor"], ["clean", "--released",
                                                            "--dry-run"]):
        code, out, err = run(*argv, "--root", str(store_root))
        assert code == 0, (argv, out, err)
        if argv[0] == "status":
            assert json.loads(out)["released"]["entries"] == 1
        _assert_unchanged(store_root, before, argv)  # reading never upgrades
    with Store.open(store_root) as s:  # the first write
        assert s.release(_ids("k2")[0])
    assert "hints-log" in _marker(store_root)["requires"]
    log = (store_root / "state" / "hints.log").read_text()
    assert set(log.split()) >= {"release", *_ids("k1", "k2")}
    proc = _previous(previous_build, "status", "--root", str(store_root))
    assert proc.returncode == 2 and "hints-log" in proc.stderr  # no going back unnoticed
    _assert_releases_survive_a_rebuild(store_root, {"k1", "k2"})


def _assert_releases_survive_a_rebuild(root: Path, released: set[str]) -> None:
    _drop_catalog(root)
    with Store.open(root) as s:
        assert s.catalog.totals().entries == 4  # rebuilt from the manifests
        assert {r.entry_id for r in s.catalog.list(hint="release")} == set(_ids(*released))
        assert s.clean_released().entries == len(released)  # the next clean frees them
        assert s.catalog.totals().entries == 4 - len(released)


@pytest.mark.parametrize("step", ["catalog.hints_seeded", "upgrade.hints_seeded"])
def test_a_crash_in_the_middle_of_the_upgrade_leaves_a_store_both_builds_open(
        previous_build: Path, store_root: Path, step: str) -> None:
    proc = _previous(previous_build, "-c", _PUT, str(store_root), "4", "k1", module=False)
    assert proc.returncode == 0, proc.stderr
    crash = subprocess.run(
        [sys.executable, "-c", "import sys; from spoolctl.store import Store; "
         "Store.open(sys.argv[1]).close()", str(store_root)],
        env={**os.environ, "SPOOLCTL_CRASH_AT": step}, capture_output=True, text=True,
        timeout=120)
    assert crash.returncode == CRASH_EXIT_CODE, crash.stderr
    assert "requires" not in _marker(store_root)  # not upgraded: still the old format
    # The previous build still works on it, and changes a hint without the log.
    proc = _previous(previous_build, "-c", _PUT, str(store_root), "0", "k3", module=False)
    assert proc.returncode == 0, proc.stderr
    proc = _previous(previous_build, "status", "--root", str(store_root))
    assert proc.returncode == 0, proc.stderr
    with Store.open(store_root) as s:  # the next write finishes the upgrade, from the catalog
        assert s.released()[0] == 2
    assert "hints-log" in _marker(store_root)["requires"]
    _assert_releases_survive_a_rebuild(store_root, {"k1", "k3"})


def test_a_rebuild_keeps_releases_quarantine_reasons_and_scrub_progress(
        store_root: Path) -> None:
    with Store.open(store_root, create=True) as s:
        for i in range(4):
            s.put(kind="mlx", namespace="ns", key=f"k{i}", objects={"o": b"%d" % i * 300})
        s.release(_ids("k1")[0])
        s.release(_ids("k2")[0])
    code, _, err = run("scrub", "--root", str(store_root), "--max-items", "2")
    assert code == 0, err
    with Store.open(store_root) as s:  # a damaged object: quarantined, with its reason
        obj = s.layout.object_path(s.manifest(_ids("k3")[0]).objects[0].digest)
        obj.chmod(0o600)
        obj.write_bytes(b"rot" * 100)
        with pytest.raises(CorruptionError):
            s.verify(_ids("k3")[0])
    before = run("status", "--json", "--root", str(store_root))[1]
    quarantined = run("quarantine", "ls", "--json", "--root", str(store_root))[1]
    (store_root / "state" / "catalog.sqlite3").write_bytes(b"not a database" * 100)
    for suffix in ("-wal", "-shm"):
        (store_root / "state" / f"catalog.sqlite3{suffix}").unlink(missing_ok=True)
    with Store.open(store_root) as s:  # damaged: quarantined and rebuilt
        released = {r.entry_id for r in s.catalog.list(hint="release")}
    after = json.loads(run("status", "--json", "--root", str(store_root))[1])
    kept = json.loads(before)
    assert released == set(_ids("k1", "k2"))
    assert after["released"] == kept["released"]
    assert after["scrub"] == kept["scrub"]
    items = json.loads(run("quarantine", "ls", "--json", "--root", str(store_root))[1])
    reasons = {(i["reason"], i.get("entry_id")) for i in items["items"]}
    assert {(i["reason"], i.get("entry_id"))
            for i in json.loads(quarantined)["items"]} <= reasons
    assert "catalog" in {r for r, _ in reasons}  # the damaged catalog, as evidence


def _make_v1(root: Path) -> None:
    """The catalog as a spoolctl of catalog schema 1 wrote it."""
    db = sqlite3.connect(root / "state" / "catalog.sqlite3", isolation_level=None)
    for name in ("malformed_ins", "malformed_upd", "malformed_del"):
        db.execute(f"DROP TRIGGER {name}")
    db.execute("DROP TABLE malformed_rows")
    db.execute(DDL_V1.strip().splitlines()[-1])
    db.execute("UPDATE meta SET v='1' WHERE k='schema'")
    db.close()


def test_read_commands_never_migrate_an_older_catalog(previous_build: Path,
                                                      store_root: Path) -> None:
    proc = _previous(previous_build, "-c", _PUT, str(store_root), "3", "k1", module=False)
    assert proc.returncode == 0, proc.stderr
    _make_v1(store_root)
    before = _snapshot(store_root)
    for argv in (["status"], ["ls"], ["doctor"]):
        code, out, err = run(*argv, "--root", str(store_root))
        assert code == 0, (argv, out, err)
        _assert_unchanged(store_root, before, argv)
    with Store.open(store_root) as s:  # the first write migrates it, hints kept
        assert s.released()[0] == 1
    db = sqlite3.connect(store_root / "state" / "catalog.sqlite3")
    assert db.execute("SELECT v FROM meta WHERE k='schema'").fetchone() == ("2",)
    db.close()


def test_a_newer_catalog_is_refused_in_one_line_and_never_rebuilt(store_root: Path) -> None:
    with Store.open(store_root, create=True) as s:
        s.put(kind="mlx", namespace="ns", key="k0", objects={"o": b"x" * 300})
        s.release(_ids("k0")[0])
    db = sqlite3.connect(store_root / "state" / "catalog.sqlite3", isolation_level=None)
    db.execute("CREATE TABLE future_facts(entry_id TEXT PRIMARY KEY)")
    db.execute("UPDATE meta SET v='3' WHERE k='schema'")
    db.close()
    before = _snapshot(store_root)
    for argv in (["status"], ["inspect", _ids("k0")[0]],
                 ["clean", "--released", "--yes"], ["init"]):
        code, out, err = run(*argv, "--root", str(store_root))
        assert code == 2, (argv, out, err)
        assert "catalog has schema 3" in err and "up to 2" in err, err
        assert _snapshot(store_root) == before, argv


@pytest.mark.parametrize("damage", ["garbage", "deleted"])
def test_a_read_command_never_rebuilds_a_damaged_catalog(tmp_path: Path, damage: str) -> None:
    """A damaged (or lost) catalog is reported by every read command, in one line, with the
    store left as it was; the next command that writes rebuilds it, releases kept."""
    root = tmp_path / "store"
    with Store.open(root, create=True) as store:
        made = [store.put(kind="pytorch", namespace="ns", key=f"k{i}",
                          objects={"kv": os.urandom(500)}) for i in range(3)]
        store.release(made[0].entry_id)
    catalog = root / "state" / "catalog.sqlite3"
    for suffix in ("-wal", "-shm"):
        Path(f"{catalog}{suffix}").unlink(missing_ok=True)
    if damage == "garbage":
        catalog.write_bytes(b"garbage" * 1000)
    else:
        catalog.unlink()
    before = _snapshot(root)
    for argv in (("status",), ("ls",), ("inspect", made[1].entry_id), ("metrics",),
                 ("quarantine", "ls")):
        code, out, err = run(*argv, "--root", str(root))
        assert code == 1 and "does not rebuild it" in err and len(err.splitlines()) == 1, \
            (argv, code, out, err)
        _assert_unchanged(root, before, argv)
    code, _, err = run("scrub", "--root", str(root))  # a command that writes rebuilds it
    assert code == 0, err
    with Store.open(root, read_only=True) as store:
        assert store.totals().entries == 3
        assert store.row(made[0].entry_id).hint == "release"
