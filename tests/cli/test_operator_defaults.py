"""Issue 36, items 2, 3 and 6: a store is bounded unless someone chooses otherwise and `init`
says when nothing changed (2); a dry run reports exactly what the run then does, step by
step, on the same store (3); destructive commands do not act on everything by default and
do not ask when there is nothing to delete (6). Small real stores, the CLI in-process except
where only a terminal shows the behaviour."""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

import pytest
from operator_cli import ENV, SPOOLCTL, run, run_json

from spoolctl.controllers.local.engine import default_max_bytes
from spoolctl.store import CLEAN_STEPS, Store
from spoolctl.store.format.digest import hash_bytes

pytestmark = pytest.mark.base  # store + CLI only: runs on a base install too

HOUR = 3600.0


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return Path(os.path.realpath(tmp_path)) / "store"


def _blob(seed: str, size: int = 4096) -> bytes:
    return random.Random(seed).randbytes(size)


# -- item 2: bounded by default; "nothing changed" ---------------------------------------


def test_init_without_a_max_size_creates_a_bounded_store(root: Path) -> None:
    doc = run_json("init", "--root", str(root))
    assert doc["created"] and doc["default_max_bytes"]
    assert doc["max_bytes"] == default_max_bytes(root) > 0
    with Store.open(root) as store:
        assert store.max_bytes == doc["max_bytes"]


def test_init_on_an_existing_store_says_when_nothing_changed(root: Path) -> None:
    run_json("init", "--root", str(root), "--max-size", "64MiB")
    code, out, _ = run("init", "--root", str(root))
    assert code == 0 and "store unchanged" in out and "nothing changed" in out
    assert "store updated" not in out
    same = run_json("init", "--root", str(root), "--max-size", "64MiB")
    assert not same["changed"] and same["max_bytes"] == 64 << 20
    changed = run_json("init", "--root", str(root), "--max-size", "128MiB")
    assert changed["changed"] and changed["previous_max_bytes"] == 64 << 20
    code, out, _ = run("init", "--root", str(root), "--max-size", "32MiB")
    assert code == 0 and "store updated" in out and "nothing changed" not in out


def test_config_vllm_requires_a_max_size(root: Path) -> None:
    code, out, err = run("config", "vllm", "--root", str(root))
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--max-size" in lines[0] and "unbounded" in lines[0]
    code, out, _ = run("config", "vllm", "--root", str(root), "--max-size", "200GiB")
    assert code == 0 and '"spoolctl_max_size":"200GiB"' in out


# -- item 3: a dry run tells the truth, per clean step -----------------------------------


def _messy_store(root: Path) -> None:
    """Everything each clean step acts on, with the traps that made dry runs lie: released
    entries whose objects other entries share (retained or released), a store over its max
    size that the released step alone does not bring under it, temp files of a dead writer
    and orphan objects, all old enough."""
    shared, pair = _blob("shared"), _blob("pair")
    now = [time.time() - 1000]  # the store's clock: a stable LRU order
    with Store.open(root, create=True, clock=lambda: now[0]) as store:
        for i in range(12):  # retained, least recently used first
            now[0] += 1
            store.put(kind="pytorch", namespace="m", key=f"r{i}",
                      objects={"kv": _blob(f"r{i}"), **({"s": shared} if i < 3 else {})})
        now[0] = time.time()
        doomed = [store.put(kind="pytorch", namespace="m", key=f"x{i}",
                            objects={"kv": _blob(f"x{i}"), "s": shared}).entry_id
                  for i in range(3)]  # released; their "s" stays referenced
        doomed += [store.put(kind="mlx", namespace="m", key=f"p{i}",
                             objects={"kv": pair}).entry_id for i in range(2)]  # one object
        for entry_id in doomed:
            store.release(entry_id)
        total = store.totals().bytes
        store.set_max_bytes(int(total * 0.8))  # over even once the released are gone
        layout = store.layout
    old = time.time() - 2 * HOUR
    # Temp files a clean deletes: a live writer's that are too old to be in flight, and one
    # whose name names no writer (a dead writer's are reclaimed when a store opens).
    for i, name in enumerate([f"1-{7:016x}.part", "stray.part"]):
        part = layout.tmp / name
        part.write_bytes(_blob(f"t{i}", 1000))
        os.utime(part, (old, old))
    for i in range(2):  # orphan objects nothing references
        data = _blob(f"o{i}", 3000)
        path = layout.object_path(hash_bytes(data))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.utime(path, (old, old))


_COUNTS = ("entries", "objects", "files", "bytes")


def _counts(doc: dict) -> dict:
    return {step: {k: r.get(k, 0) for k in _COUNTS} for step, r in doc["steps"].items()}


@pytest.mark.parametrize("steps", [[s] for s in CLEAN_STEPS] + [[]],
                         ids=[*CLEAN_STEPS, "all"])
def test_a_dry_run_reports_exactly_what_the_run_does(root: Path, steps: list[str]) -> None:
    _messy_store(root)
    flags = [f"--{s}" for s in steps]
    dry = run_json("clean", "--root", str(root), *flags, "--dry-run")
    real = run_json("clean", "--root", str(root), *flags, "--yes")
    assert _counts(dry) == _counts(real)
    assert dry["total"] == real["total"]
    assert any(v for r in _counts(real).values() for v in r.values())  # it did something


# -- item 6: destructive defaults ----------------------------------------------------------


def _quarantined(root: Path) -> None:
    with Store.open(root, create=True) as store:
        entry = store.put(kind="pytorch", namespace="m", key="k", objects={"kv": _blob("q")})
        path = store.layout.object_path(store.manifest(entry.entry_id).objects[0].digest)
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    assert run("scrub", "--root", str(root), "--rate", "0")[0] == 1


def test_quarantine_purge_needs_ids_or_all(root: Path) -> None:
    _quarantined(root)
    code, _, err = run("quarantine", "purge", "--root", str(root), "--yes")
    assert code == 2 and "--all" in err and len(err.strip().splitlines()) == 1
    assert run_json("quarantine", "ls", "--root", str(root))["count"] == 1  # nothing purged
    code, _, err = run("quarantine", "purge", "--root", str(root), "--all", "--older-than",
                       "1d", "--yes")
    assert code == 2 and run_json("quarantine", "ls", "--root", str(root))["count"] == 1
    assert run_json("quarantine", "purge", "--root", str(root), "--all", "--yes")["count"] == 1
    assert run_json("quarantine", "ls", "--root", str(root))["count"] == 0


def _clean_on_a_terminal(root: Path, answer: bytes) -> subprocess.CompletedProcess:
    """`spoolctl clean` with a terminal as stdin (a real pty), answering ``answer``."""
    master, slave = os.openpty()
    try:
        os.write(master, answer)
        return subprocess.run([SPOOLCTL, "clean", "--root", str(root)], stdin=slave,
                              capture_output=True, env=ENV, timeout=120)
    finally:
        os.close(slave)
        os.close(master)


def test_clean_on_a_terminal_asks_only_when_something_would_be_deleted(root: Path) -> None:
    with Store.open(root, create=True, max_bytes=1 << 30) as store:
        entry = store.put(kind="pytorch", namespace="m", key="k", objects={"kv": _blob("a")})
    idle = _clean_on_a_terminal(root, b"n\n")
    assert idle.returncode == 0, idle.stderr
    assert b"Delete these?" not in idle.stdout + idle.stderr  # nothing to delete: no question
    with Store.open(root) as store:
        store.release(entry.entry_id)
    asked = _clean_on_a_terminal(root, b"n\n")
    assert asked.returncode == 0 and b"Delete these?" in asked.stdout + asked.stderr
    with Store.open(root) as store:  # answered no: nothing deleted
        assert store.totals().entries == 1
