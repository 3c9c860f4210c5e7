"""SpoolTier refuses, in one line, an engine whose keys would not survive a restart or
whose requests carry what vLLM's tier API cannot bind into a key (vLLM's config objects,
no engine started)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.config import VllmConfig

from spoolctl.connector.tier.engine import engine_config
from spoolctl.connector.tier.manager import _refuse_engine
from spoolctl.errors import ConfigError


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
