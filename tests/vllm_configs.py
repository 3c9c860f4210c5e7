"""Hand-built vLLM configuration objects for connector tests that need no engine.

``SpoolConnector`` reads vLLM's ``VllmConfig`` and runtime ``KVCacheConfig`` by attribute
only, so plain namespaces with the attributes vLLM's own objects have (and real vLLM KV
cache specs) let a test construct either role in-process in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any


def vllm_configs(root: str, specs: Sequence[Any], *, num_blocks: int = 64,
                 **extra: Any) -> tuple[SimpleNamespace, SimpleNamespace]:
    """``(vllm_config, kv_cache_config)``: block size 32, chunk 64 tokens, one KV cache group
    per spec (layer ``layer.<i>``), store base ``root``; ``extra`` adds connector options."""
    tcfg = SimpleNamespace(
        kv_connector_extra_config={"spoolctl_root": root, "spoolctl_chunk_tokens": 64,
                                   **extra},
        kv_load_failure_policy="recompute")
    vcfg = SimpleNamespace(
        kv_transfer_config=tcfg,
        cache_config=SimpleNamespace(block_size=32, cache_dtype="auto"),
        model_config=SimpleNamespace(model="/m", revision=None, dtype="float32",
                                     multimodal_config=None),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        decode_context_parallel_size=1))
    kcfg = SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[
        SimpleNamespace(layer_names=[f"layer.{i}"], kv_cache_spec=spec)
        for i, spec in enumerate(specs)])
    return vcfg, kcfg
