"""``scripts/gpu_check.py`` runs end to end on CPU at CI sizes (the GPU figures come from
running the same script on a CUDA host), and the copy layer it checks never imports vLLM."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from testpaths import REPO_DIR

pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = REPO_DIR / "scripts" / "gpu_check.py"


def test_gpu_check_runs_on_cpu_and_every_layout_is_byte_exact(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--repeat", "1",
         "--tokens", "160,320", "--work", str(tmp_path)],
        capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert doc["ok"] is True and doc["device"]["type"] == "cpu"
    seen = {(r["layout"], r["page"], r["kernel_blocks"]) for r in doc["layouts"]}
    for layout in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"):
        for page in ("attention", "mla", "packed"):
            assert (layout, page, 1) in seen
    assert ("LBNHC", "attention", 2) in seen  # kernel blocks split a manager block
    assert all(r["identical"] for r in doc["layouts"])
    copy = doc["copy"]
    # On CPU there is nothing to pin: said so, never a made-up figure.
    assert copy["pinned"] is None and "CUDA" in copy["pinned_reason"]
    for label in ("consecutive", "scattered"):
        row = copy["pageable"][label]
        assert row["capture_s"] > 0 and row["capture_vs_reference"] > 0
    runs = doc["controller"]["runs"]
    assert [r["disk_hit_source"] for r in runs] == ["disk", "disk"]
    assert all(r["same_tokens"] for r in runs)
    assert runs[0]["prompt_tokens"] < runs[1]["prompt_tokens"]
    assert runs[0]["entry_bytes"] < runs[1]["entry_bytes"]
    # The store the layouts went through: every chunk committed and verified.
    assert (tmp_path / "layouts-store" / ".spoolctl-root").exists()


def test_gpu_check_refuses_to_pretend_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert "no CUDA device" in json.loads(out.stdout)["error"]


def test_copy_layer_never_imports_vllm():
    code = ("import sys, spoolctl.connector.kv.kvio, spoolctl.connector.kv.layouts;"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"
