"""The cache is bound to the weights that computed it (decisions 2110, 2111), real vLLM.

Four engine processes (each a restart) on a private copy of the tiny model:

A  cold on store R: the base model, then the same prompt through LoRA adapter 1.
B  restart, nothing changed: both restored with identical tokens; adapter 2 (other
   weights) is cold.
   Then ``model.safetensors`` is rewritten in place with other weights (same size, same
   mtime restored: only the ctime tells).
C  restart on store R with the new weights: cold, and identical to D.
D  the new weights on a fresh store: the cold reference.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_engines import run_engine

from spoolctl import metrics as m

pytestmark = pytest.mark.slow

CHUNK = 64
rng = random.Random(29)
P1 = [rng.randrange(3, 500) for _ in range(3 * CHUNK + 9)]  # 3 complete chunks
LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}


def counter(out: dict, spec: m.MetricSpec, **labels: str) -> float:
    slot = out["scheduler_counters"].get(spec.name, {})
    return slot.get(",".join(f"{k}={labels[k]}" for k in sorted(labels)), 0)


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from spoolctl.demo.tinymodel import TinyModelSpec, build_tiny_lora, build_tiny_model

    work = Path(os.path.realpath(tmp_path_factory.mktemp("weights")))
    model = work / "model"
    shutil.copytree(tiny_model_dir, model)
    other = build_tiny_model(work / "other", TinyModelSpec(seed=1))
    ad1 = build_tiny_lora(model, work / "adapter-1", seed=1)
    ad2 = build_tiny_lora(model, work / "adapter-2", seed=2)
    root, fresh = work / "store", work / "fresh"
    extra = {"spoolctl_chunk_tokens": CHUNK, "spoolctl_weights_memo": str(work / "memo")}

    def job(store: Path, requests: list[dict]) -> dict:
        return {"model": str(model), "root": str(store), "extra": extra,
                "llm_kwargs": LORA, "requests": requests}

    base = {"name": "base", "tokens": P1}
    lora1 = {"name": "lora1", "tokens": P1, "lora": ["adapter", 1, str(ad1)]}
    lora2 = {"name": "lora2", "tokens": P1, "lora": ["adapter-2", 2, str(ad2)]}
    a = run_engine(job(root, [base, lora1]), work, "A")
    b = run_engine(job(root, [base, lora1, lora2]), work, "B")

    weights = model / "model.safetensors"
    new = (other / "model.safetensors").read_bytes()
    st = weights.stat()
    assert len(new) == st.st_size and new != weights.read_bytes()
    with open(weights, "r+b") as f:  # in place: same inode, same size
        f.write(new)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the old mtime
    after = weights.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == \
        (st.st_ino, st.st_size, st.st_mtime_ns)

    c = run_engine(job(root, [base]), work, "C")
    d = run_engine(job(fresh, [base]), work, "D")
    return {"A": a, "B": b, "C": c, "D": d, "root": root}


def test_unchanged_weights_are_restored(runs):
    a, b = runs["A"], runs["B"]
    assert a["results"]["base"]["num_cached_tokens"] == 0
    assert b["results"]["base"]["num_cached_tokens"] == 3 * CHUNK
    assert b["results"]["base"]["tokens"] == a["results"]["base"]["tokens"]
    assert a["namespace"] == b["namespace"]


def test_weights_replaced_at_the_same_path_start_cold_and_match_a_fresh_run(runs):
    a, c, d = runs["A"], runs["C"], runs["D"]
    assert c["results"]["base"]["num_cached_tokens"] == 0
    assert counter(c, m.HIT_TOKENS) == 0
    assert c["results"]["base"]["tokens"] == d["results"]["base"]["tokens"]
    # The new weights really compute something else (else this proves nothing).
    assert d["results"]["base"]["tokens"] != a["results"]["base"]["tokens"]
    # A new deployment directory under the same root; the old one is left to `clean`.
    assert c["namespace"] != a["namespace"] and c["store_root"] != a["store_root"]
    assert len(list(runs["root"].iterdir())) == 2


def test_a_lora_adapter_gets_its_own_persistent_prefix_cache(runs):
    a, b = runs["A"], runs["B"]
    assert a["results"]["lora1"]["tokens"] != a["results"]["base"]["tokens"]  # it acts
    assert a["results"]["lora1"]["num_cached_tokens"] == 0  # not the base model's chunks
    assert b["results"]["lora1"]["num_cached_tokens"] == 3 * CHUNK
    assert b["results"]["lora1"]["tokens"] == a["results"]["lora1"]["tokens"]
    assert counter(a, m.LOOKUPS, result="bypass", reason="lora") == 0


def test_another_adapter_is_cold(runs):
    b = runs["B"]
    assert b["results"]["lora2"]["num_cached_tokens"] == 0
    assert b["results"]["lora2"]["tokens"] != b["results"]["lora1"]["tokens"]
