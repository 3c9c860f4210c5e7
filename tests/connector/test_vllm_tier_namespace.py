"""A restart that changes what the model computes on the same root never finds the other
setting's chunks; one that changes only the CPU tier's size still restores them.

A  cold: stores the prompt's 3 chunks.
B  the same model files with ``hf_overrides`` (another RoPE base, as an operator enabling
   RoPE scaling does): vLLM's block hashes are the same, the KV is not, so the tier must
   miss every chunk (a hit would serve KV computed with the other RoPE).
C  A's configuration with another ``cpu_bytes_to_use``: every chunk restores from the
   tier with A's tokens.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_engines import run_engine

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).resolve().parent.parent / "vllm_tier_driver.py"
BLOCK = 32
rng = random.Random(3113)
PROMPT = [rng.randrange(3, 500) for _ in range(3 * BLOCK + 5)]
OTHER_ROPE = {"rope_parameters": {"rope_theta": 500.0, "rope_type": "default"}}


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-tier-ns")))
    base = {"model": str(tiny_model_dir), "root": str(work / "store"), "block_size": BLOCK}
    return {
        "a": run_engine({**base, "requests": [{"tokens": PROMPT, "entries": 3}]}, work, "a",
                        driver=DRIVER),
        "b": run_engine({**base, "llm_kwargs": {"hf_overrides": OTHER_ROPE},
                         "requests": [{"tokens": PROMPT}]}, work, "b", driver=DRIVER),
        "c": run_engine({**base, "cpu_bytes": 16 << 20, "requests": [{"tokens": PROMPT}]},
                        work, "c", driver=DRIVER),
    }


def test_another_rope_on_the_same_files_never_hits(runs: dict) -> None:
    b = runs["b"]
    assert b["namespace"] != runs["a"]["namespace"]
    assert b["requests"][0]["cached"] == 0 and b["counters"]["load_chunks"] == 0


def test_another_cpu_tier_size_still_restores(runs: dict) -> None:
    a, c = runs["a"], runs["c"]
    assert c["namespace"] == a["namespace"]
    assert c["requests"][0]["tokens"] == a["requests"][0]["tokens"]
    assert c["requests"][0]["cached"] == 3 * BLOCK and c["counters"]["load_chunks"] == 3
