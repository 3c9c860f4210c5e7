"""Issue 15.4 and 15.5: a full disk can always be shed, and the size bound holds for
streaming puts.

On a real, small tmpfs that another program fills to 100% (not one free block left),
recording a release, deleting released entries, collecting orphans, lowering the max size
and evicting down to it all work, each run as its own process after the disk was filled
again (decision 1103: the store's reserve pieces and commit headroom). The control case
shows the reserve is what makes it work: without it the same steps fail, and the message
no longer advises the command that just failed.

A put whose payload streams is bounded while it streams: a put too large for the store
fails in ``tmp/`` and leaves nothing behind (twenty rejected 200 kB puts into a 100 kB
store used to leave 4 MB of orphans)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from operator_cli import run, script

from spoolctl.store import CapacityError, ConfigError, Store, StoreIOError

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)


def fill(fs: Path) -> None:
    """Fill ``fs`` to 100%, like another program would (a big file, then small ones)."""
    for block in (1 << 16, 1 << 12, 1 << 9):
        try:
            with open(fs / f"filler-{time.monotonic_ns()}", "wb") as f:
                while True:
                    f.write(b"\0" * block)
                    f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    assert os.statvfs(fs).f_bavail == 0


def _store_on(fs: Path, *, entries: int = 12, size: int = 400_000) -> tuple[Path, list]:
    root = fs / "store"
    with Store.open(root, create=True, max_bytes=8 << 20) as store:
        made = [store.put(kind="pytorch", namespace="ns", key=f"k{i}",
                          objects={"kv": os.urandom(size)}) for i in range(entries)]
        store._committer.publish_object("kv", os.urandom(300_000))  # an orphan object
    return root, made


def test_every_shedding_step_works_on_a_full_disk(mount_tmpfs) -> None:
    fs = mount_tmpfs("16m")
    root, made = _store_on(fs)
    fill(fs)
    with Store.open(root) as store:  # recording a release
        assert store.release(made[0].entry_id) and store.release(made[1].entry_id)
    fill(fs)
    proc = script("clean", "--released", "--yes", "--json", "--root", str(root))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps"]["released"]["entries"] == 2
    fill(fs)
    proc = script("clean", "--orphans", "--min-age", "0s", "--yes", "--json", "--root", str(root))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps"]["orphans"]["objects"] == 1
    fill(fs)
    proc = script("init", "--max-size", "2MiB", "--json", "--root", str(root))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["over_max"] is True
    fill(fs)
    proc = script("clean", "--capacity", "--yes", "--json", "--root", str(root))
    assert proc.returncode == 0, proc.stderr
    with Store.open(root, read_only=True) as store:
        assert store.max_bytes == 2 << 20
        assert store.totals().bytes <= 0.9 * (2 << 20) and store.released() == (0, 0)
        for row in store.entries():  # what is left is whole
            store.read_all(store.manifest(row.entry_id))


def test_operations_that_free_nothing_keep_working_on_a_disk_kept_full(mount_tmpfs) -> None:
    """A release frees nothing, and each process needs room for SQLite's scratch files: the
    store takes that room back into its reserve when it closes, so the next one has it too,
    however many times another program fills the disk in between."""
    fs = mount_tmpfs("16m")
    root, made = _store_on(fs, entries=10, size=100_000)
    for m in made:
        fill(fs)
        proc = subprocess.run(
            [sys.executable, "-c", "from spoolctl.store import Store\n"
             f"with Store.open({str(root)!r}) as s: assert s.release({m.entry_id!r})"],
            capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    with Store.open(root, read_only=True) as store:
        assert store.released()[0] == len(made)
        assert store.reserve.count == store.reserve.pieces


def test_without_the_reserve_the_steps_fail_and_say_what_to_do(mount_tmpfs) -> None:
    fs = mount_tmpfs("16m")
    root, made = _store_on(fs, entries=4)
    for piece in (root / "state").glob("reserve.*"):
        piece.unlink()
    fill(fs)
    with pytest.raises(StoreIOError) as info, Store.open(root) as store:
        store.release(made[0].entry_id)
    assert "reserve is used up" in str(info.value)
    assert "spoolctl clean" not in str(info.value)  # never advise what just failed
    proc = script("clean", "--released", "--yes", "--root", str(root))
    assert proc.returncode == 2 and "free space on this filesystem" in proc.stderr


def test_commits_stop_short_of_a_full_disk(mount_tmpfs) -> None:
    fs = mount_tmpfs("8m")
    root = fs / "store"
    with Store.open(root, create=True) as store:
        with pytest.raises(StoreIOError) as info:
            for i in range(100):
                store.put(kind="pytorch", namespace="ns", key=f"k{i}",
                          objects={"kv": os.urandom(200_000)})
        assert "No space left" in str(info.value) and "free disk space" in str(info.value)
        assert store.reserve.count == store.reserve.pieces  # the store never ate it
        victim = store.entries(limit=1)[0].entry_id
        assert store.release(victim)
        assert store.clean_released().entries == 1


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for sub in ("objects", "tmp") for p in (root / sub).rglob("*")
               if p.is_file())


def test_rejected_streaming_puts_leave_nothing_and_stop_early(store_root: Path) -> None:
    consumed = []

    def stream(n: int = 20, size: int = 10_000):
        for i in range(n):
            consumed.append(i)
            yield os.urandom(size)

    with Store.open(store_root, create=True, max_bytes=100_000) as store:
        for k in range(20):
            with pytest.raises(CapacityError, match="does not fit"):
                store.put(kind="pytorch", namespace="ns", key=f"big{k}",
                          objects={"kv": stream()})
        # the bound holds while streaming: a put stops after its budget (90 kB) plus one
        # chunk, not after the whole 200 kB
        assert len(consumed) <= 20 * 10
        assert _tree_bytes(store_root) == 0
        # two objects that fit alone but not together: the second fails while staging,
        # nothing of the first is published either
        with pytest.raises(CapacityError):
            store.put(kind="pytorch", namespace="ns", key="pair",
                      objects={"a": stream(6), "b": stream(6)})
        assert _tree_bytes(store_root) == 0
        ok = store.put(kind="pytorch", namespace="ns", key="fits", objects={"kv": stream(5)})
        assert bytes(store.read(ok, "kv"))[:1] is not None
    code, out, err = run("status", "--check", "--json", "--root", str(store_root))
    assert code == 0 and json.loads(out)["bytes"] < 100_000, err


def test_a_stream_that_yields_non_bytes_leaves_nothing(store_root: Path) -> None:
    with Store.open(store_root, create=True) as store:
        with pytest.raises(ConfigError, match="not bytes-like"):
            store.put(kind="pytorch", namespace="ns", key="k",
                      objects={"a": b"x" * 1000, "b": iter([b"ok", "text"])})
        assert _tree_bytes(store_root) == 0 and store.totals().entries == 0
