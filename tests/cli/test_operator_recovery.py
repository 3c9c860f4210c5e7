"""Issue 30: the operator's recovery path.

30.1: an ``init`` killed or failed half-way is finished by the next ``init`` (it used to
refuse its own leftovers as "not a spoolctl store", and ``doctor`` advised the very ``init``
that refused: a circle whose only exit was ``rm -rf``). Only what an unfinished init makes
is adopted; anything else in the directory still makes it refuse.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faultseam import CRASH_EXIT_CODE
from operator_cli import run, run_json, script
from testpaths import TESTS_DIR

from spoolctl.store import Store, StoreIOError
from spoolctl.store.disk.root import StorePaths, ensure_layout

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)


def _doctor(root: Path) -> dict[str, dict]:
    _, out, _ = run("doctor", "--root", str(root), "--json")
    return {c["name"]: c for c in json.loads(out)["checks"]}


# -- 30.1 an interrupted or failed init can be rerun -------------------------------------------


@pytest.mark.parametrize("point", ["init.layout_made", "init.marker_drafted"])
def test_init_killed_half_way_is_finished_by_the_next_init(store_root: Path, point: str) -> None:
    proc = script("init", "--root", str(store_root), env={"SPOOLCTL_CRASH_AT": point})
    assert proc.returncode == CRASH_EXIT_CODE, proc.stderr
    assert not (store_root / ".spoolctl-root").exists() and (store_root / "objects").is_dir()
    drafts = os.listdir(store_root / "tmp")
    assert len(drafts) == (1 if point == "init.marker_drafted" else 0)

    # other commands and doctor name it and point at the one command that finishes it
    code, _, err = run("status", "--root", str(store_root))
    assert code == 2 and "unfinished `spoolctl init`" in err and "init --root" in err
    check = _doctor(store_root)["root.marker"]
    assert check["status"] == "fail" and "unfinished" in check["detail"]
    assert f"spoolctl init --root {store_root}" in check["fix"]

    doc = run_json("init", "--root", str(store_root), "--max-size", "1MiB")
    assert doc["created"] is True and doc["max_bytes"] == 1 << 20
    assert os.listdir(store_root / "tmp") == []  # the dead init's draft is gone
    with Store.open(store_root) as store:
        m = store.put(kind="mlx", namespace="ns", key="k", objects={"a": b"x" * 10})
        assert bytes(store.read(m, "a")) == b"x" * 10


@pytest.mark.parametrize("extra", ["objects/ab/planted.obj", "state/catalog.sqlite3",
                                   "notes.txt", "manifests/zz/"])
def test_init_still_refuses_a_directory_holding_anything_else(store_root: Path,
                                                             extra: str) -> None:
    store_root.mkdir(mode=0o700)
    ensure_layout(StorePaths(store_root))  # what init makes before its marker
    target = store_root / extra
    if extra.endswith("/"):
        target.mkdir()
    else:
        target.write_bytes(b"someone's data")
    code, _, err = run("init", "--root", str(store_root))
    assert code == 2 and ("refusing to adopt" in err or "not a spoolctl store" in err), err
    assert not (store_root / ".spoolctl-root").exists()
    assert target.exists()


def test_init_that_ran_out_of_inodes_is_named_and_finished_after_room_is_made(
        mount_tmpfs) -> None:
    fs = mount_tmpfs("8m", inodes=300)  # a store's layout needs 518 directories
    root = fs / "store"
    code, _, err = run("init", "--root", str(root))
    assert code == 2 and "inodes" in err, err
    assert "unexpected" not in err
    assert _doctor(root)["root.marker"]["detail"].startswith("an unfinished")
    proc = subprocess.run(["mount", "-o", "remount,nr_inodes=2000", str(fs)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert run_json("init", "--root", str(root))["created"] is True
    assert _doctor(root)["root.marker"]["status"] == "ok"


# -- 30.2 out of inodes is named, checked, measured, and clean still works ----------------------


def _fill_inodes(fs: Path) -> list[Path]:
    """Take every free inode of ``fs``, like another program making small files would."""
    (fs / "filler").mkdir(exist_ok=True)
    made: list[Path] = []
    while True:
        path = fs / "filler" / f"f{time.monotonic_ns()}"
        try:
            path.touch()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            break
        made.append(path)
    assert os.statvfs(fs).f_favail == 0 and os.statvfs(fs).f_bavail > 1000
    return made


def test_out_of_inodes_is_named_in_errors_doctor_and_metrics_and_clean_frees_them(
        mount_tmpfs) -> None:
    fs = mount_tmpfs("16m", inodes=1500)  # bytes to spare; the layout takes ~520 inodes
    root = fs / "store"
    with Store.open(root, create=True, max_bytes=8 << 20) as store:
        made = [store.put(kind="mlx", namespace="ns", key=f"k{i}", objects={"a": b"x" * 100})
                for i in range(20)]
        assert _doctor(root)["fs.inodes"]["status"] == "ok"
        fillers = _fill_inodes(fs)
        with pytest.raises(StoreIOError, match="inodes") as caught:
            store.put(kind="mlx", namespace="ns", key="new", objects={"a": b"y"})
        assert "free disk space" not in str(caught.value)  # `df -h` shows space
    os.unlink(fillers.pop())  # one inode left: doctor is not "ok"
    check = _doctor(root)["fs.inodes"]
    assert check["status"] == "fail" and "1 of 1500 inodes free" in check["detail"]
    assert "spoolctl clean" in check["fix"]
    _, text, _ = run("metrics", "--root", str(root))
    assert "spoolctl_fs_free_inodes 1.0" in text and "spoolctl_fs_inodes 1500.0" in text
    assert run_json("status", "--root", str(root))["filesystem"]["free_inodes"] == 1

    _fill_inodes(fs)  # and now none left
    with Store.open(root) as store:  # recording releases works at 0 inodes (the reserve)
        for m in made[:10]:
            assert store.release(m.entry_id)
    _fill_inodes(fs)  # the other program takes what the releases gave back
    doc = run_json("clean", "--root", str(root), "--released", "--yes")
    assert doc["steps"]["released"]["entries"] == 10 and doc["failed"] == 0, doc
    assert os.statvfs(fs).f_favail >= 10  # inodes came back (some went to the reserve again)


# -- 30.6 a gauge never says a store that is gone is healthy -------------------------------------


def test_metrics_textfile_says_store_up_0_once_the_store_cannot_be_read(tmp_path: Path) -> None:
    base = Path(os.path.realpath(tmp_path))
    root, prom = base / "store", base / "spoolctl.prom"
    with Store.open(root, create=True) as store:
        store.put(kind="mlx", namespace="ns", key="k", objects={"a": b"x"})
    assert run("metrics", "--root", str(root), "--textfile", str(prom))[0] == 0
    assert "spoolctl_store_up 1.0" in prom.read_text()

    root.rename(base / "store.moved")  # renamed directory, or a disk no longer mounted
    code, _, err = run("metrics", "--root", str(root), "--textfile", str(prom))
    assert code == 2 and "does not exist" in err
    gauges = [line for line in prom.read_text().splitlines() if not line.startswith("#")]
    assert gauges == ["spoolctl_store_up 0.0",  # the alert on store_up == 0 fires, and why
                      'spoolctl_store_down_reason{reason="missing"} 1.0']

    (base / "store.moved").rename(root)
    (root / ".spoolctl-root").unlink()  # no longer a store at all
    assert run("metrics", "--root", str(root), "--textfile", str(prom))[0] == 2
    assert "spoolctl_store_up 0.0" in prom.read_text()


def test_metrics_textfile_on_an_unmounted_vllm_root_says_store_up_0(tmp_path: Path) -> None:
    """The vLLM root is a mount point: unmounted, an empty directory stays where the stores
    were. It holds no store, so the file says `store_up 0` (the alert fires), exit 2."""
    base = Path(os.path.realpath(tmp_path))
    mount, prom = base / "nvme0", base / "spoolctl.prom"
    rank = mount / ("vllm-v1-" + "ab" * 24) / "rank-0000"
    assert run("init", "--root", str(rank), "--max-size", "1MiB")[0] == 0
    assert run("metrics", "--root", str(mount), "--textfile", str(prom))[0] == 0
    assert 'spoolctl_store_up{deployment="vllm-v1-' in prom.read_text()
    shutil.rmtree(mount)
    mount.mkdir()  # what an unmounted mount point looks like
    code, _, err = run("metrics", "--root", str(mount), "--textfile", str(prom))
    assert code == 2 and "is its disk mounted?" in err
    gauges = [line for line in prom.read_text().splitlines() if not line.startswith("#")]
    assert gauges == ["spoolctl_store_up 0.0", 'spoolctl_store_down_reason{reason="missing"} 1.0']


# -- 30.7 a timestamp from the future protects nothing ------------------------------------------

YEAR = 364 * 86400


def test_an_orphan_from_the_future_is_reclaimed_and_a_fresh_one_is_not(store_root: Path) -> None:
    with Store.open(store_root, create=True) as store:
        store.put(kind="mlx", namespace="ns", key="k", objects={"a": b"kept"})
        ahead = store._committer.publish_object("a", b"written while the clock ran ahead").digest
        fresh = store._committer.publish_object("a", b"a commit in flight a moment ago").digest
    ahead_path = store_root / "objects" / ahead[:2] / f"{ahead}.obj"
    fresh_path = store_root / "objects" / fresh[:2] / f"{fresh}.obj"
    future = time.time() + YEAR
    os.utime(ahead_path, (future, future))

    doc = run_json("clean", "--root", str(store_root), "--orphans", "--yes")
    assert not ahead_path.exists() and fresh_path.exists(), doc  # default --min-age: 1h
    assert run_json("clean", "--root", str(store_root), "--orphans", "--yes",
                    "--min-age", "0s")["failed"] == 0
    assert not fresh_path.exists()  # and --min-age 0s means now, not "unless from the future"


def test_entries_stamped_ahead_do_not_outrank_todays_in_the_lru(store_root: Path) -> None:
    ahead = lambda: time.time() + YEAR  # noqa: E731 (a clock that ran a year ahead)
    payload = b"x" * 4000
    with Store.open(store_root, create=True, clock=ahead) as store:
        future = [store.put(kind="mlx", namespace="ns", key=f"ahead{i}",
                            objects={"a": payload}).entry_id for i in range(20)]
    with Store.open(store_root) as store:  # the clock is right again
        hot = [store.put(kind="mlx", namespace="ns", key=f"hot{i}",
                         objects={"a": payload}).entry_id for i in range(20)]
        store.touch(future[:1])  # used today: its real recency counts from now on
        assert store.catalog.get(future[0]).last_access <= time.time()
        store.set_max_bytes(store.totals().bytes * 3 // 4)
        report = store.enforce_capacity()
        assert report.entries >= 10
        gone = set(report.entry_ids)
        assert not gone & set(hot), "entries used today were evicted first"
        assert future[0] not in gone and gone <= set(future[1:])

    code, out, _ = run("ls", "--root", str(store_root))
    # a past time ahead of the clock says so, never "in 364d" (nor "0s ago": decision 3040)
    assert code == 0 and "in 36" not in out and " in " not in \
        out.replace("in/", "").replace("in the future", "")


# -- 30.4 / 30.5 doctor's fixes fit who runs it; root leaves nothing the owner cannot use --------

RUNNER = str(TESTS_DIR.joinpath("unprivileged.py"))
sys.path.insert(0, str(TESTS_DIR))
from owned_stores import owned_store, shared_dir  # noqa: E402
from unprivileged import unprivileged_uid  # noqa: E402

needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="another user's store needs root to set up")


def as_user(*args: str) -> subprocess.CompletedProcess:
    """``spoolctl ARGS`` as the unprivileged user (tests/unprivileged.py)."""
    return script(RUNNER, "cli", *args, program=sys.executable, cwd="/tmp")


@pytest.fixture
def shared_base():
    """A directory the unprivileged user can reach (pytest's tmp_path is root-only)."""
    yield from shared_dir("spool-ops-")


@needs_root
def test_root_on_another_users_store_leaves_state_the_owner_can_use(shared_base: Path) -> None:
    root, _ = owned_store(shared_base, 3)
    uid = unprivileged_uid()
    code, _, err = run("--allow-foreign-owner", "scrub", "--root", str(root), "--until-complete")
    assert code == 0, err
    for top in ("state", "tmp", "quarantine"):
        mine = [p for p in (root / top).rglob("*") if p.lstat().st_uid != uid]
        assert mine == [], f"root left files the owner cannot use: {mine}"
    proc = as_user("scrub", "--root", str(root), "--until-complete")  # the owner's cron job
    assert proc.returncode == 0, proc.stderr

    # a file an older spoolctl (or a hand) left root-owned: doctor names it and the owner
    planted = root / "state" / "scrub.lock"
    os.lchown(planted, 0, 0)
    check = _doctor(root)["store.files"]
    assert check["status"] == "fail" and str(planted) in check["detail"]
    assert f"chown -R {uid}:{uid} {root}" in check["fix"]


@needs_root
def test_doctor_as_a_non_owner_does_not_advise_chown_to_itself(shared_base: Path) -> None:
    root = shared_base / "store"
    with Store.open(root, create=True) as store:
        store.put(kind="mlx", namespace="ns", key="k", objects={"a": b"x"})
    subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True)  # world-readable, root's
    proc = as_user("doctor", "--root", str(root), "--json")
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    me = unprivileged_uid()
    wrong = [c for c in checks.values() if "chown" in c["fix"] and str(me) in c["fix"]]
    assert wrong == [], "doctor advised giving the store to the user who ran it"
    assert checks["root.writable"]["status"] == "fail"
    assert "run spoolctl as uid 0" in checks["root.writable"]["fix"]


def test_doctor_names_a_read_only_mount_as_what_it_is(mount_tmpfs) -> None:
    fs = mount_tmpfs("16m")
    root = fs / "store"
    assert run_json("init", "--root", str(root))["created"] is True
    proc = subprocess.run(["mount", "-o", "remount,ro", str(fs)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    checks = _doctor(root)
    assert checks["fs.read_only"]["status"] == "fail"
    assert "remount" in checks["fs.read_only"]["fix"]
    for check in checks.values():
        if check["status"] == "fail":
            assert "chown" not in check["fix"] and "free space" not in check["fix"], check
