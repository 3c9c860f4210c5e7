"""What the tier learns from the vLLM engine it runs in (imports vLLM).

vLLM hands a secondary tier only the offloading config; the hash algorithm and the LoRA
setting live in the engine's ``VllmConfig``, which the scheduler building the tier holds.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.v1.core import kv_cache_utils

# ModelConfig fields that change the KV a model computes for the same tokens and files:
# hf_overrides land in hf_config (RoPE scaling, layer counts), quantization may be online.
COMPUTE_FIELDS = ("dtype", "hf_config", "quantization", "quantization_config",
                  "disable_sliding_window", "model_impl", "model_class_overrides")
# CacheConfig fields that change which layers hold which bytes at the same chunk size.
CACHE_FIELDS = ("kv_cache_dtype_skip_layers", "mamba_cache_dtype", "mamba_ssm_cache_dtype",
                "sliding_window")

# How many caller frames to search for the scheduler's config (the tier is built a few
# calls below ``Scheduler.__init__``).
_FRAMES = 24


def engine_config() -> VllmConfig | None:
    """The ``VllmConfig`` of the engine building this tier, None if none is found."""
    current = get_current_vllm_config_or_none()
    if current is not None:
        return current
    frame = inspect.currentframe()
    try:
        for _ in range(_FRAMES):
            if frame is None:
                return None
            found = _config_in(frame.f_locals)
            if found is not None:
                return found
            frame = frame.f_back
    finally:
        del frame  # frames reference each other: break the cycle at once
    return None


def _config_in(scope: dict[str, Any]) -> VllmConfig | None:
    for value in (scope.get("vllm_config"), getattr(scope.get("self"), "vllm_config", None)):
        if isinstance(value, VllmConfig):
            return value
    return None


def hash_algo(config: VllmConfig | None) -> str | None:
    return None if config is None else config.cache_config.prefix_caching_hash_algo


def engine_generation() -> str:
    """vLLM's major.minor and device type (``vllm-0.32/cpu``): the attention kernels of
    another release or device may lay a chunk's bytes out otherwise."""
    from spoolctl.connector.vllm_api.introspect import engine_tag

    return engine_tag()


def model_computation(config: VllmConfig | None) -> str | None:
    """A digest of the engine's model and cache settings that change a chunk's KV for the
    same tokens, files and chunk size (``COMPUTE_FIELDS``, ``CACHE_FIELDS``); None without
    a config."""
    if config is None:
        return None
    from vllm.config.utils import hash_factors, normalize_value

    factors: dict[str, object] = {}
    for part, names in (("model_config", COMPUTE_FIELDS), ("cache_config", CACHE_FIELDS)):
        for name in names:
            value = getattr(getattr(config, part), name, None)
            try:
                factors[name] = normalize_value(value)
            except TypeError:  # a value vLLM cannot render stably: its text tells apart
                factors[name] = f"{type(value).__qualname__}:{value}"
    return hash_factors(factors)


def model_revision(config: VllmConfig | None) -> str | None:
    """The model revision the engine loaded (a hub branch, tag or commit), None if unset."""
    revision = None if config is None else config.model_config.revision
    return None if revision is None else str(revision)


def seed_is_stable() -> bool:
    """Whether the block-hash chain's seed, once vLLM resolved it, is the same in every
    process (the fixed default or ``PYTHONHASHSEED``); True before it is resolved."""
    seed = kv_cache_utils._NONE_HASH_SEED
    if seed is None:
        return True
    return seed in (kv_cache_utils.DEFAULT_NONE_HASH_SEED, os.environ.get("PYTHONHASHSEED"))
