"""Several processes on one store: commits, releases and cleaning race without losing
hints or rows, and no reader ever sees a verification failure on a healthy entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from testpaths import TESTS_DIR
from waiting import wait_until

from spoolctl.store import Store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

WORKER = str(TESTS_DIR.joinpath("store_worker.py"))


def test_two_committers_and_a_cleaner_lose_nothing(store_root: Path, tmp_path: Path) -> None:
    Store.open(store_root, create=True).close()
    env = {k: v for k, v in os.environ.items() if k != "SPOOLCTL_CRASH_AT"}
    outs = {name: tmp_path / f"{name}.json" for name in ("p1", "p2")}
    procs = [
        subprocess.Popen([sys.executable, WORKER, str(store_root), "churn", name, "4", str(out)],
                         env=env, stderr=subprocess.PIPE, text=True)
        for name, out in outs.items()
    ]
    procs.append(subprocess.Popen([sys.executable, WORKER, str(store_root), "cleaner", "4"],
                                  env=env, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
    with Store.open(store_root) as store:
        rows = {r.key: r for r in store.entries(namespace="churn", include_pending=True)}
        total = 0
        for out in outs.values():
            expected = json.loads(out.read_text())
            assert expected, "the worker made no progress"
            total += len(expected)
            for key, hint in expected.items():
                if hint == "retain":
                    assert key in rows and rows[key].hint == "retain", key
                    m = store.lookup("pytorch", "churn", key)
                    store.read(m, "a")
                else:  # released: still released, or already cleaned away
                    assert key not in rows or rows[key].hint == "release", key
        for i in range(7):
            assert f"shared-{i}" in rows
        assert all(r.state == "committed" for r in rows.values())
        assert store.quarantine_items() == []
        assert total > 20


def test_threads_commit_and_read_one_store(store: Store) -> None:
    """Four threads commit, read back and release while a clean runs in the middle of their
    work: the clean deletes exactly entries released before it, no retained entry is lost,
    and every read returns the bytes committed."""
    import time

    errors: list[BaseException] = []
    progress = threading.Semaphore(0)  # one release per thread per signal
    cleaned = threading.Event()
    committed: dict[str, bytes] = {}
    released: dict[str, float] = {}  # entry id -> when release() returned
    spans: dict[int, list[tuple[float, float]]] = {n: [] for n in range(4)}

    def work(n: int) -> None:
        try:
            i, after_clean = 0, 0
            while after_clean < 5:  # keep committing until 5 iterations past the clean
                start = time.monotonic()
                data = f"{n}-{i}".encode() * 100
                m = store.put(kind="mlx", namespace="t", key=f"{n}-{i}", objects={"a": data})
                assert bytes(store.read(m, "a")) == data
                committed[m.entry_id] = data
                if i % 2:
                    assert store.release(m.entry_id)
                    released[m.entry_id] = time.monotonic()
                    progress.release()
                spans[n].append((start, time.monotonic()))
                i += 1
                after_clean += cleaned.is_set()
        except BaseException as exc:  # collected for the main thread
            errors.append(exc)
            progress.release()

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for _ in range(8):  # at least 8 entries released (by any threads) before the clean
        assert progress.acquire(timeout=60)
    clean_start = time.monotonic()
    report = store.clean_released()
    clean_end = time.monotonic()
    cleaned.set()
    for t in threads:
        t.join()
    assert not errors, errors
    # The clean ran while every thread was committing: each one worked before and after it.
    for n, done in spans.items():
        assert done[0][0] < clean_start and done[-1][1] > clean_end, n
    before_clean = {e for e, t in released.items() if t < clean_start}
    assert len(before_clean) >= 8 and before_clean <= set(report.entry_ids)
    assert set(report.entry_ids) <= set(released)  # it deleted released entries only
    assert report.entries == len(report.entry_ids)
    store.clean_released()
    retained = set(committed) - set(released)
    assert {r.entry_id for r in store.entries()} == retained
    for entry_id in retained:
        assert bytes(store.read(store.manifest(entry_id), "a")) == committed[entry_id]


def test_a_deleter_is_not_starved_by_back_to_back_commits(store_root: Path) -> None:
    """flock has no writer preference; the gate makes a clean get in while commits run."""
    Store.open(store_root, create=True).close()
    stop = threading.Event()
    errors: list[BaseException] = []
    commits = [0, 0, 0]

    def committer(n: int) -> None:
        try:
            with Store.open(store_root) as s:
                while not stop.is_set():
                    s.put(kind="vllm", namespace="gate", key=f"{n}-{commits[n]}",
                          objects={"a": b"x" * 512})
                    commits[n] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=committer, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    try:
        # every committer is committing back to back before the deleter comes
        wait_until(lambda: all(c >= 3 for c in commits) or errors, what="three busy committers")
        with Store.open(store_root, lock_timeout=20) as s:
            for _ in range(5):
                s.clean_released()  # raises BusyError if starved for 20 s
        assert all(c >= 3 for c in commits)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors
