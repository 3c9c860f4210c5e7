"""SpoolTier refuses, in one line, an engine whose keys would not survive a restart, whose
requests carry what vLLM's tier API cannot bind into a key (vLLM's config objects, no engine
started), a tier API other than the one it implements, or an encrypted store (a real engine
start: vLLM's tier API passes no tenant)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from testpaths import TESTS_DIR
from vllm.config import VllmConfig
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

from spoolctl.connector.tier.api_check import api_differences
from spoolctl.connector.tier.engine import engine_config
from spoolctl.connector.tier.manager import SpoolTier, _refuse_engine
from spoolctl.errors import ConfigError

TIER_DRIVER = TESTS_DIR / "vllm_tier_driver.py"


@pytest.fixture(scope="module")
def config() -> VllmConfig:
    return VllmConfig()


def engine_with(config: VllmConfig, **fields: Any) -> VllmConfig:
    """A copy of ``config`` with ``fields`` set (vLLM's validation would rebuild the rest)."""
    engine = copy.copy(config)
    for name, value in fields.items():
        object.__setattr__(engine, name, value)
    return engine


def scheduler_building_the_tier(vllm_config: VllmConfig) -> VllmConfig | None:
    return engine_config()


def test_the_tier_finds_the_engine_config_of_the_scheduler_building_it(config) -> None:
    assert scheduler_building_the_tier(config) is config
    assert engine_config() is None


def test_the_default_sha256_engine_is_accepted(config, monkeypatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    _refuse_engine(config)


def test_a_per_process_hash_seed_is_refused(config, monkeypatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    xx = dataclasses.replace(config.cache_config, prefix_caching_hash_algo="xxhash")
    engine = engine_with(config, cache_config=xx)
    with pytest.raises(ConfigError, match="PYTHONHASHSEED") as exc:
        _refuse_engine(engine)
    assert "\n" not in str(exc.value)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    _refuse_engine(engine)


def test_no_engine_config_and_lora_are_refused(config) -> None:
    with pytest.raises(ConfigError, match="configuration"):
        _refuse_engine(None)
    with pytest.raises(ConfigError, match="LoRA"):
        _refuse_engine(engine_with(config, lora_config=object()))


def test_this_vllms_tier_api_is_the_one_spooltier_implements() -> None:
    assert api_differences(SecondaryTierManager, SpoolTier) == []


@pytest.mark.slow
def test_an_encrypted_store_is_refused_at_start_up_naming_the_root_and_the_fix(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "store"
    job = {"model": str(tiny_model_dir), "root": str(root), "requests": []}
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
               SPOOLCTL_MASTER_KEY=secrets.token_hex(32))
    proc = subprocess.run([sys.executable, str(TIER_DRIVER), str(tmp_path / "job.json"),
                           str(tmp_path / "out.json")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0 and not (tmp_path / "out.json").exists()
    [line] = {line.split("ConfigError: ", 1)[1] for line in proc.stderr.splitlines()
              if "ConfigError: SpoolTier" in line}
    assert "SpoolTier cannot use an encrypted store" in line
    assert f"({root})" in line and "use SpoolConnector" in line and "SPOOLCTL_MASTER_KEY" in line
