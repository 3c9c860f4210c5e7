"""A real engine start with a SpoolTier entry an operator got wrong refuses in one
ConfigError line naming the option and the fix, instead of a raw OSError in vLLM's
traceback (a read-only root) or an engine that serves and never stores a chunk (a
max_size below two chunks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from testpaths import TESTS_DIR

TIER_DRIVER = TESTS_DIR / "vllm_tier_driver.py"


def refusal(model: Path, tmp_path: Path, root: Path, tier: dict) -> str:
    """The one ConfigError line of an engine start that must refuse."""
    job = {"model": str(model), "root": str(root), "tier": tier, "requests": []}
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, str(TIER_DRIVER), str(tmp_path / "job.json"),
                           str(tmp_path / "out.json")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0 and not (tmp_path / "out.json").exists(), proc.stderr[-2000:]
    lines = {line.split("ConfigError: ", 1)[1] for line in proc.stderr.splitlines()
             if "ConfigError: " in line}
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines.pop()


@pytest.mark.slow
def test_a_read_only_root_is_refused_naming_root(tiny_model_dir: Path, tmp_path: Path,
                                                 mount_tmpfs) -> None:
    read_only_root = mount_tmpfs("1m", read_only=True) / "store"
    line = refusal(tiny_model_dir, tmp_path, read_only_root, {})
    assert "read-only filesystem" in line and "SpoolTier option 'root'" in line


@pytest.mark.slow
def test_a_max_size_below_two_chunks_is_refused_naming_max_size(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    line = refusal(tiny_model_dir, tmp_path, tmp_path / "store", {"max_size": "1KiB"})
    assert "'max_size'" in line and "nothing would ever be stored" in line
    assert not (tmp_path / "store").exists()


def test_the_tier_binds_the_device_type_into_its_namespace(monkeypatch) -> None:
    """A store moved from (or shared with) an engine on another device is another
    namespace: the attention kernels lay a chunk's bytes out per device."""
    from vllm.platforms import current_platform

    from spoolctl.connector.tier.engine import engine_generation

    here = engine_generation()
    assert here.endswith(f"/{current_platform.device_type}")
    other = "cuda" if current_platform.device_type != "cuda" else "cpu"
    monkeypatch.setattr(current_platform, "device_type", other)
    assert engine_generation() != here


def test_settings_that_change_the_kv_at_one_chunk_size_change_the_namespace() -> None:
    from types import SimpleNamespace

    from spoolctl.connector.tier.engine import model_computation

    def engine(skip: list[str], theta: float) -> SimpleNamespace:
        from transformers import LlamaConfig

        hf = LlamaConfig(rope_parameters={"rope_theta": theta, "rope_type": "default"})
        return SimpleNamespace(model_config=SimpleNamespace(dtype="float32", hf_config=hf),
                               cache_config=SimpleNamespace(kv_cache_dtype_skip_layers=skip))

    base = model_computation(engine(["0"], 1e4))
    assert base == model_computation(engine(["0"], 1e4))  # stable for one configuration
    assert base != model_computation(engine(["1"], 1e4))
    assert base != model_computation(engine(["0"], 5e2))
    assert model_computation(None) is None
