"""The bytes of a PyTorch entry: ``PyTorchBackend.serialize`` / ``deserialize``.

KV tensors are one safetensors object (``kv``: ``k0, v0, k1, v1, ...``, each ``[1, kv_heads,
tokens, head_dim]``; mixed layers by ``layers``); nothing is pickled or ``torch.load``-ed.
Loading checks names, count, shapes and dtype against the model before a tensor reaches it;
any mismatch is a ValueError (a miss).
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..local.safetensors_layout import tiling_error
from . import layers as hf_layers
from .runtime import TorchRuntime

KV_OBJECT = "kv"
MAX_HEADER = 16 << 20  # a KV header lists 2 tensors per layer: far below this


def layout_of(backend: TorchRuntime) -> dict[str, Any]:
    if backend.layers is not None:  # what each layer holds (kind, window, state shapes)
        return {"encoding": "safetensors", "object": KV_OBJECT, "cache": hf_layers.LAYOUT_NAME,
                "layers": backend.layers, "dtype": str(backend.dtype).removeprefix("torch."),
                "batch": 1}
    return {"encoding": "safetensors", "object": KV_OBJECT, "layers": backend.num_layers,
            "kv_heads": backend.kv_heads, "head_dim": backend.head_dim,
            "dtype": str(backend.dtype).removeprefix("torch."), "batch": 1}


def serialize(backend: TorchRuntime, cache: Any, token_count: int
              ) -> tuple[dict[str, bytes | memoryview], dict]:
    if backend.layers is not None:
        if backend.length(cache) != token_count:
            raise ValueError(f"cache holds {backend.length(cache)} tokens, not {token_count}")
        named = hf_layers.tensors(cache, backend.layers, token_count)
        return {KV_OBJECT: backend.safetensors.save(named)}, layout_of(backend)
    tensors = {}
    kv = backend.kv_pairs(cache)
    if len(kv) != backend.num_layers:
        raise ValueError(f"cache has {len(kv)} layers, the model {backend.num_layers}")
    for i, (k, v) in enumerate(kv):
        for name, t in ((f"k{i}", k), (f"v{i}", v)):
            if tuple(t.shape) != (1, backend.kv_heads, token_count, backend.head_dim):
                raise ValueError(f"cache tensor {name} has shape {tuple(t.shape)}")
            tensors[name] = t.detach().to("cpu").contiguous()
    return {KV_OBJECT: backend.safetensors.save(tensors)}, layout_of(backend)


def deserialize(backend: TorchRuntime, objects: dict[str, memoryview], layout: dict,
                token_count: int) -> Any:
    if layout != layout_of(backend):
        raise ValueError(f"stored layout {layout} does not match the model {layout_of(backend)}")
    if set(objects) != {KV_OBJECT}:
        raise ValueError(f"expected one object {KV_OBJECT!r}, found {sorted(objects)}")
    tensors = _tensors_from(backend, objects[KV_OBJECT])
    if backend.layers is not None:
        want = hf_layers.expected(backend.layers, token_count)
        if sorted(tensors) != sorted(want):
            raise ValueError("stored tensor names do not match the model's layers")
        for name, (shape, dtype) in want.items():
            t = tensors[name]
            dt = backend.dtype if dtype is None else getattr(backend.torch, dtype)
            if tuple(t.shape) != shape or t.dtype != dt:
                raise ValueError(f"stored tensor {name} {tuple(t.shape)} {t.dtype} does "
                                 f"not match {shape} {dt}")
        cache = hf_layers.fill(backend.new_cache(), backend.layers, tensors, token_count,
                               backend.device)
        if backend.length(cache) != token_count:
            raise ValueError("loaded cache length differs from the token count")
        return cache
    names = [f"{kind}{i}" for i in range(backend.num_layers) for kind in ("k", "v")]
    if sorted(tensors) != sorted(names):
        raise ValueError("stored tensor names do not match the model's layers")
    shape = (1, backend.kv_heads, token_count, backend.head_dim)
    cache = backend.new_cache()
    for i in range(backend.num_layers):
        k, v = tensors[f"k{i}"], tensors[f"v{i}"]
        for t in (k, v):
            if tuple(t.shape) != shape or t.dtype != backend.dtype:
                raise ValueError(f"stored tensor {tuple(t.shape)} {t.dtype} does not match "
                                 f"{shape} {backend.dtype}")
        cache.update(k.to(backend.device), v.to(backend.device), i)
    if backend.length(cache) != token_count:
        raise ValueError("loaded cache length differs from the token count")
    return cache


def _tensors_from(backend: TorchRuntime, data: memoryview) -> dict[str, Any]:
    """Parse a safetensors buffer into tensors that VIEW it (no copy; the cache copies
    once when it takes them). Strict: every offset, dtype and size is checked."""
    torch = backend.torch
    data = memoryview(data)
    if data.readonly:
        # torch cannot make a tensor that views a read-only buffer without undefined
        # behaviour on write (and warns); the store's verified reads are writable, so
        # only bytes handed in by other callers are copied, once.
        data = memoryview(bytearray(data))
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    if len(data) < 8:
        raise ValueError("KV object too short for a safetensors header")
    n = int.from_bytes(data[:8], "little")
    if not 2 <= n <= min(len(data) - 8, MAX_HEADER):
        raise ValueError("bad safetensors header length")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except RecursionError:  # absurdly deep nesting: hostile, not a cache we wrote
        raise ValueError("safetensors header is nested too deeply") from None
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not an object")
    body = len(data) - 8 - n
    out: dict[str, Any] = {}
    spans: list[tuple[int, int]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"bad safetensors entry {name!r}")
        # only a str can name a dtype (a list or dict here is unhashable, not a miss)
        dtype = dtypes.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        shape, offsets = info["shape"], info["data_offsets"]
        if dtype is None:
            raise ValueError(f"unsupported tensor dtype {str(info['dtype'])[:20]!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= body):
            raise ValueError(f"bad shape or offsets for tensor {name!r}")
        numel = math.prod(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel * itemsize != offsets[1] - offsets[0] or numel == 0:
            raise ValueError(f"tensor {name!r} size does not match its shape")
        out[name] = torch.frombuffer(data, dtype=dtype, count=numel,
                                     offset=8 + n + offsets[0]).view(shape)
        spans.append((offsets[0], offsets[1]))
    if (why := tiling_error(spans, body)) is not None:
        raise ValueError(f"bad safetensors body: {why}")
    return out
