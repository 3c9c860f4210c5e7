"""Issue 35: a store's writer cannot attack the operator, the engine or another tenant.

The attacker owns the store (the serving user: here ``nobody``, through
``tests/unprivileged.py``) and can write nothing else; the operator is root, running the
documented maintenance with ``--allow-foreign-owner``. Root ignores mode bits, so where
the machine does not run the tests as root the attacks still run as this user against its
own commands (the descriptors, schema checks and modes are the same code), and only the
"root-only victim" assertions are skipped.

* 35.1: a ``tmp/`` swapped for a symlink between root's listing and its unlinks (made
  deterministic with ``SPOOLCTL_PAUSE_AT=tmp.listed``) deletes nothing outside the store;
  the same for fan-out directories swapped under ``clean --released``, ``doctor``'s probe
  and a symlinked ``quarantine/``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import sqlite3
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from testpaths import REPO_DIR, TESTS_DIR

from spoolctl.store import Store

RUNNER = str(TESTS_DIR.joinpath("unprivileged.py"))
sys.path.insert(0, str(TESTS_DIR))
from operator_cli import ENV  # noqa: E402
from owned_stores import give, owned_store, shared_dir  # noqa: E402
from waiting import Paused  # noqa: E402

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

AS_ROOT = os.geteuid() == 0
CLI = "import sys; from spoolctl.cli.app import main; main(sys.argv[1:])"
DEAD_TMP = "999999999-0123456789abcdef.part"  # a temp-file name whose writer is dead


def _env(**extra: str) -> dict[str, str]:
    """The CLI tests' environment (tests/operator_cli.py) plus ``extra``."""
    return ENV | extra


def attacker(code: str) -> None:
    """Run ``code`` as the store's owner (``nobody`` when the tests run as root)."""
    proc = subprocess.run([sys.executable, RUNNER, "py", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120, env=_env(), cwd="/tmp")
    assert proc.returncode == 0, proc.stderr


def operator(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``spoolctl ARGS`` as this (root) user, as cron would, on the owner's store."""
    return subprocess.Popen([sys.executable, "-c", CLI, "--allow-foreign-owner", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or _env(), cwd="/tmp")


@pytest.fixture
def base():
    """A directory both users can reach (pytest's tmp_path is root-only)."""
    yield from shared_dir("spool-hostile-")


def _victim(base: Path, name: str) -> Path:
    """A root-only directory holding ``name``: what the attacker wants root to delete."""
    secret = base / "secret"
    secret.mkdir(mode=0o700)
    (secret / name).write_bytes(b"precious\n")
    return secret / name


# -- 35.1: descriptors, not paths -----------------------------------------------------------


def test_tmp_swapped_for_a_symlink_after_the_listing_deletes_nothing_outside(
        base: Path) -> None:
    root, _ = owned_store(base, 2)
    precious = _victim(base, DEAD_TMP)
    (root / "tmp" / DEAD_TMP).write_bytes(b"bait\n")  # listed by root's clean
    give(root)
    pause = Paused(base=base, point="tmp.listed")
    proc = operator("clean", "--tmp", "--yes", "--json", "--root", str(root), env=_env(**pause.env))
    pause.wait_reached(proc)
    attacker(f"""
        import os
        os.rename({str(root / 'tmp')!r}, {str(root / 'tmp.moved')!r})
        os.symlink({str(precious.parent)!r}, {str(root / 'tmp')!r})
    """)
    pause.resume()
    out, err = proc.communicate(timeout=120)
    assert precious.read_bytes() == b"precious\n", (out, err)
    # the unlink went to the directory root listed, wherever its owner moved it
    assert not (root / "tmp.moved" / DEAD_TMP).exists()
    # and the swap is not reported as a clean pass
    assert proc.returncode != 0, out
    assert f'"{root / "tmp"}": "Too many levels of symbolic links"' in out, out


def test_a_fanout_swapped_mid_clean_deletes_nothing_outside(base: Path) -> None:
    root, made = owned_store(base, n=1, released=1)
    digest = made[0].objects[0].digest
    precious = _victim(base, f"{digest}.obj")
    pause = Paused(base=base, point="clean.manifest_deleted")
    proc = operator("clean", "--released", "--yes", "--json", "--root", str(root),
                    env=_env(**pause.env))
    pause.wait_reached(proc)  # the manifest is gone; the object's unlink comes next
    fan = root / "objects" / digest[:2]
    attacker(f"""
        import os
        os.rename({str(fan)!r}, {str(fan) + '.moved'!r})
        os.symlink({str(precious.parent)!r}, {str(fan)!r})
    """)
    pause.resume()
    out, err = proc.communicate(timeout=120)
    assert precious.read_bytes() == b"precious\n", (out, err)
    assert proc.returncode != 0 and "Too many levels of symbolic links" in out, (out, err)


def test_doctor_reports_a_symlinked_tmp_and_writes_nothing_through_it(base: Path) -> None:
    root, _ = owned_store(base, 2)
    secret = base / "secret"
    secret.mkdir(mode=0o700)
    os.utime(secret, ns=(1, 1))
    attacker(f"""
        import os
        os.rename({str(root / 'tmp')!r}, {str(root / 'tmp.moved')!r})
        os.symlink({str(secret)!r}, {str(root / 'tmp')!r})
    """)
    proc = operator("doctor", "--json", "--root", str(root))
    out, err = proc.communicate(timeout=120)
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["root.layout"]["status"] == "fail", checks
    assert "tmp (symlink)" in checks["root.layout"]["detail"]
    assert proc.returncode == 1, err
    # the probe files were neither created nor removed in the link's target
    assert os.stat(secret).st_mtime_ns == 1 and not os.listdir(secret)


def test_a_quarantine_swapped_mid_purge_is_not_purged_through(base: Path) -> None:
    root, _ = owned_store(base, 2)
    item = "20260101T000000Z-payload_digest-0123abcd"
    for where in (root / "quarantine", base / "secret"):
        (where / item).mkdir(parents=True, mode=0o700)
        (where / item / "reason.json").write_text('{"reason": "payload_digest"}')
    (base / "secret" / item / "precious").write_bytes(b"precious\n")
    (base / "secret").chmod(0o700)
    give(root)
    pause = Paused(base=base, point="quarantine.listed")
    proc = operator("quarantine", "purge", "--all", "--yes", "--root", str(root),
                    env=_env(**pause.env))
    pause.wait_reached(proc)
    attacker(f"""
        import os
        os.rename({str(root / 'quarantine')!r}, {str(root / 'quarantine.moved')!r})
        os.symlink({str(base / 'secret')!r}, {str(root / 'quarantine')!r})
    """)
    pause.resume()
    out, err = proc.communicate(timeout=120)
    assert (base / "secret" / item / "precious").read_bytes() == b"precious\n", (out, err)
    assert proc.returncode != 0, out



@pytest.mark.parametrize("batched", [False, True])
def test_a_rename_after_the_check_never_follows_a_swapped_directory(
        tmp_path: Path, batched: bool) -> None:
    """The window between ``check_dirs`` and the rename (``checked=True``): a fan-out
    swapped there for a link takes no file, alone or in a group commit's batch."""
    from spoolctl.store.disk.publish import Publisher

    root = Path(os.path.realpath(tmp_path)) / "root"
    (root / "tmp").mkdir(parents=True)
    (root / "objects" / "aa").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    pub = Publisher(root, root / "tmp", lambda name: None)
    with pub.batch() if batched else contextlib.nullcontext():
        staged = pub.stage([b"data"], what=None)
        final = root / "objects" / "aa" / "x.obj"
        pub.check_dirs(final.parent)
        (root / "objects" / "aa").rename(root / "objects" / "aa.moved")  # the swap
        (root / "objects" / "aa").symlink_to(elsewhere)
        with pytest.raises(OSError) as caught:
            pub.place(staged.tmp, final, what=None, checked=True)
    assert caught.value.errno == errno.ELOOP
    assert list(elsewhere.iterdir()) == []


# -- 35.3: planted SQL never runs -------------------------------------------------------------

ENDLESS = ("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) "
           "SELECT count(*) FROM r")


def _plant(db_path: Path, *statements: str) -> None:
    """Write ``statements`` into a database the way its owner could (plain sqlite3)."""
    db = sqlite3.connect(db_path)
    try:
        for statement in statements:
            db.execute(statement)
        db.commit()
    finally:
        db.close()


def _finish(proc: subprocess.Popen) -> tuple[str, str]:
    """The output of ``proc``; a failure (not a hung test run) if it spins past 90 s."""
    try:
        return proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the command spun on planted SQL")


def test_a_trigger_planted_in_the_catalog_never_runs(base: Path) -> None:
    root, made = owned_store(base, n=3)
    _plant(root / "state" / "catalog.sqlite3",
           f"CREATE TRIGGER spin BEFORE INSERT ON meta BEGIN {ENDLESS}; END",
           f"CREATE TRIGGER spin2 BEFORE UPDATE ON entries BEGIN {ENDLESS}; END")
    proc = operator("status", "--json", "--root", str(root))  # a read: reported, not rebuilt
    out, err = _finish(proc)
    assert proc.returncode == 1, err
    assert "does not rebuild it" in err and "'spin'" in err, err
    out, err = _finish(operator("scrub", "--json", "--root", str(root)))  # a write rebuilds it
    assert "catalog quarantined and rebuilt" in err and "'spin'" in err, err
    out, err = _finish(operator("status", "--json", "--root", str(root)))
    assert json.loads(out)["entries"] == 3, err  # rebuilt from the manifests
    with Store.open(root, allow_foreign_owner=True) as store:  # the rebuilt file is ours
        assert store.live([m.entry_id for m in made]) == {m.entry_id for m in made}


def test_doctor_reports_a_view_planted_in_place_of_a_table(base: Path) -> None:
    root, _ = owned_store(base, n=2)
    _plant(root / "state" / "catalog.sqlite3", "DROP TABLE entries",
           f"CREATE VIEW entries AS SELECT * FROM ({ENDLESS})")
    proc = operator("doctor", "--json", "--root", str(root))
    out, err = _finish(proc)
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["sqlite.catalog.sqlite3"]["status"] == "fail", checks
    assert "view 'entries'" in checks["sqlite.catalog.sqlite3"]["detail"]
    assert proc.returncode == 1, err


def test_a_trigger_planted_in_the_scrub_state_never_runs(base: Path) -> None:
    root, _ = owned_store(base, n=2)
    scrub_db = root / "state" / "scrub.sqlite3"
    out, err = _finish(operator("scrub", "--json", "--rate", "0", "--root", str(root)))
    assert scrub_db.exists(), (out, err)
    _plant(scrub_db, f"CREATE TRIGGER spin BEFORE INSERT ON cycles BEGIN {ENDLESS}; END",
           f"CREATE TRIGGER spin2 BEFORE UPDATE ON cycles BEGIN {ENDLESS}; END")
    give(root)
    out, err = _finish(operator("scrub", "--json", "--rate", "0", "--root", str(root)))
    assert json.loads(out)["checked"] == 2, (out, err)


def test_every_statement_has_a_deadline(tmp_path: Path) -> None:
    from spoolctl.store.disk.sqlite_files import connect_read_only

    path = tmp_path / "x.sqlite3"
    _plant(path, "CREATE TABLE t(x)")
    db = connect_read_only(path, deadline=0.2)
    try:
        with pytest.raises(sqlite3.OperationalError, match="interrupted"):
            db.execute(ENDLESS).fetchall()
        assert db.execute("SELECT count(*) FROM t").fetchone() == (0,)  # a new deadline
    finally:
        db.close()


# -- 35.4: modes are spoolctl's, not the umask's --------------------------------------------


def test_directories_above_a_new_root_are_private_under_any_umask(base: Path) -> None:
    code = f"""
        import os, stat
        from spoolctl.store import Store
        os.umask(0)
        root = {str(base / 'deploy' / 'dep-a' / 'rank-0000')!r}
        Store.open(root, create=True).close()
        for p in ({str(base / 'deploy')!r}, {str(base / 'deploy' / 'dep-a')!r}, root):
            print(p, oct(stat.S_IMODE(os.lstat(p).st_mode)))
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr
    modes = [line.rsplit(" ", 1)[1] for line in proc.stdout.splitlines()]
    assert modes == ["0o700", "0o700", "0o700"], proc.stdout


def test_doctor_warns_about_a_parent_others_can_write(base: Path) -> None:
    parent = base / "shared"
    parent.mkdir()
    parent.chmod(0o777)  # e.g. made under umask 000 by an older spoolctl
    with Store.open(parent / "store", create=True):
        pass
    proc = operator("doctor", "--json", "--root", str(parent / "store"))
    out, _err = _finish(proc)
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["root.parents"]["status"] == "warn", checks
    assert f"{parent} (0o777)" in checks["root.parents"]["detail"]
    parent.chmod(0o755)
    out, _err = _finish(operator("doctor", "--json", "--root", str(parent / "store")))
    assert {c["name"]: c for c in json.loads(out)["checks"]}["root.parents"]["status"] == "ok"


# -- 35.5: small ones -----------------------------------------------------------------------


def test_the_metrics_textfile_is_readable_by_node_exporter_under_umask_077(base: Path) -> None:
    root, _ = owned_store(base, 2)
    prom = base / "textfile" / "spoolctl.prom"
    prom.parent.mkdir()
    code = f"""
        import os, sys
        os.umask(0o077)
        from spoolctl.cli.app import main
        main(["--allow-foreign-owner", "metrics", "--root", {str(root)!r},
              "--textfile", {str(prom)!r}])
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr
    assert oct(stat.S_IMODE(prom.stat().st_mode)) == "0o644"
    assert "spoolctl_" in prom.read_text()


def test_the_cron_example_keeps_its_locks_where_only_the_service_writes() -> None:
    examples = REPO_DIR / "examples"
    cron = (examples / "cron" / "spoolctl").read_text()
    locks = re.findall(r"flock -n (\S+)", cron)
    assert len(locks) >= 3, cron  # clean, scrub, the daily lifecycle clean
    # the directory the systemd units let the service write, and that the stores live in
    owned = re.findall(r"ReadWritePaths=(\S+)",
                       (examples / "systemd" / "spoolctl-clean.service").read_text())
    for lock in locks:
        parent = os.path.dirname(lock)
        assert parent not in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"), lock
        assert owned and any(lock.startswith(d.rstrip("/") + "/") for d in owned), lock


@pytest.mark.skipif(not AS_ROOT, reason="needs a parent the test user can cross but not read")
def test_descriptors_cross_a_parent_that_is_searchable_but_not_readable(base: Path) -> None:
    """A home directory in mode 0711: the walk from / opens the directories on the way
    for search only (O_PATH), so the store under it works for its owner."""
    (base / "home").mkdir(mode=0o711)
    (base / "home").chmod(0o711)
    (base / "home" / "svc").mkdir(mode=0o700)
    give(base / "home" / "svc")
    os.lchown(base / "home", 0, 0)
    root = base / "home" / "svc" / "store"
    attacker(f"""
        from spoolctl.store import Store
        with Store.open({str(root)!r}, create=True) as s:
            m = s.put(kind="pytorch", namespace="ns", key="k", objects={{"kv": b"x" * 100}})
            s.release(m.entry_id)
            assert s.clean_released().entries == 1
    """)
