"""The bytes of an mlx-lm entry: ``MlxBackend.serialize`` / ``deserialize`` and the checks
that only a cache of this model, in this mlx-lm cache format, is ever loaded.

An entry holds one object, mlx-lm's own prompt-cache file (``save_prompt_cache``:
safetensors with mlx-lm's class/scalar metadata), with only the ``token_count`` used
positions of each layer; no pickle anywhere. Loading checks the layout (format, classes,
dtype, shapes, mixed layers' windows and states), the file's header before mlx-lm parses
it, and every loaded layer after: any mismatch is ``CacheFormatError`` (a miss, the entry
quarantined and rebuilt), never a crash. Functions of the backend (``backend``): no
framework import here.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

from ..local.mlx_format import (
    CacheFormatError,
    NamedBytesIO,
    PromptCache,
    describe_layer,
    dtype_name,
    safetensors_header,
)
from .runtime import MlxRuntime

#: Name of the one payload object of an entry (the mlx-lm prompt-cache file).
OBJECT_NAME = "kv"
# safetensors dtype codes mlx writes, by mlx dtype name.
_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def serialize(backend: MlxRuntime, cache: Sequence[Any], token_count: int
              ) -> tuple[dict[str, bytes | memoryview], dict]:
    """mlx-lm prompt-cache bytes of the first ``token_count`` tokens, plus layout meta."""
    if backend.size(cache) < token_count or token_count < 1:
        raise ValueError(f"cannot store {token_count} tokens of a "
                         f"{backend.size(cache)}-token cache")
    used = backend.copy_cache(cache, token_count)
    buf = io.BytesIO()
    with backend.lock:
        backend.cache_mod.save_prompt_cache(buf, used,
                                             metadata={"spoolctl_format": backend.format})
    if backend.layers is not None:
        return {OBJECT_NAME: buf.getvalue()}, _layers_layout(backend, token_count)
    layout = {
        "format": backend.format,
        "mlx_lm_version": backend.mlx_lm_version,
        "mlx_version": backend.mlx_version,
        "object": OBJECT_NAME,
        "classes": ["KVCache"] * backend.num_layers,
        "dtype": backend.dtype,
        "layers": backend.num_layers,
        "kv_heads": backend.kv_heads,
        "k_head_dim": backend.k_head_dim,
        "v_head_dim": backend.v_head_dim,
        "token_count": token_count,
    }
    return {OBJECT_NAME: buf.getvalue()}, layout


def _layers_layout(backend: MlxRuntime, token_count: int) -> dict[str, Any]:
    classes, layers = backend.expected_layout(token_count)
    out: dict[str, Any] = {"format": backend.format, "mlx_lm_version": backend.mlx_lm_version,
           "mlx_version": backend.mlx_version, "object": OBJECT_NAME,
           "classes": classes, "cache_layers": layers, "dtype": backend.dtype,
           "layers": backend.num_layers, "token_count": token_count}
    if backend.kv_bits is not None:
        out["kv_quantization"] = {"bits": backend.kv_bits, "group_size": backend.kv_group_size,
                                  "start": backend.quantized_kv_start}
    return out


def check_layout(backend: MlxRuntime, layout: Mapping[str, Any], token_count: int) -> None:
    """Raise CacheFormatError unless ``layout`` describes a cache this backend can load."""
    if backend.layers is not None:
        if dict(layout) != _layers_layout(backend, token_count):
            raise CacheFormatError("cache layout (layer classes, windows, state shapes) "
                                   "does not match this model")
        return
    fmt = layout.get("format")
    if fmt != backend.format:
        raise CacheFormatError(
            f"cache was written in format {fmt!r} (mlx-lm "
            f"{layout.get('mlx_lm_version')!r}); this mlx-lm {backend.mlx_lm_version} "
            f"reads {backend.format!r}", fix="nothing to do: it is a miss and is rebuilt")
    expected = {"object": OBJECT_NAME, "classes": ["KVCache"] * backend.num_layers,
                "dtype": backend.dtype, "layers": backend.num_layers, "kv_heads": backend.kv_heads,
                "k_head_dim": backend.k_head_dim, "v_head_dim": backend.v_head_dim,
                "token_count": token_count}
    for name, want in expected.items():
        if layout.get(name) != want:
            raise CacheFormatError(f"cache layout {name}={layout.get(name)!r} does not "
                                   f"match this model ({want!r})")


def deserialize(backend: MlxRuntime, objects: Mapping[str, memoryview | bytes],
                layout: Mapping[str, Any], token_count: int) -> list[Any]:
    """Rebuild a cache from ``serialize`` output; CacheFormatError on any mismatch."""
    check_layout(backend, layout, token_count)
    if set(objects) != {OBJECT_NAME}:
        raise CacheFormatError(f"entry holds objects {sorted(objects)}, expected "
                               f"[{OBJECT_NAME!r}]")
    data = memoryview(objects[OBJECT_NAME])
    _check_header(backend, safetensors_header(data), token_count)
    try:
        with backend.lock:
            cache, meta = backend.cache_mod.load_prompt_cache(
                NamedBytesIO(data), return_metadata=True)
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CacheFormatError(f"mlx-lm could not load the cache file: {exc}") from None
    if meta.get("spoolctl_format") != backend.format:
        raise CacheFormatError("cache file format marker does not match its manifest")
    if backend.layers is not None:
        return _checked_layers(backend, cache, token_count)
    shape_k = (1, backend.kv_heads, token_count, backend.k_head_dim)
    shape_v = (1, backend.kv_heads, token_count, backend.v_head_dim)
    for c in cache:
        try:
            ok = type(c).__name__ == "KVCache" and int(c.offset) == token_count and \
                tuple(c.keys.shape) == shape_k and tuple(c.values.shape) == shape_v and \
                dtype_name(c.keys.dtype) == backend.dtype
        except (AttributeError, TypeError, ValueError):  # a tensor missing from the file
            ok = False
        if not ok:
            raise CacheFormatError("loaded cache does not match its layout")
    if len(cache) != backend.num_layers:
        raise CacheFormatError("loaded cache has the wrong number of layers")
    return cache


def _checked_layers(backend: MlxRuntime, cache: list[Any], token_count: int
                    ) -> PromptCache:
    """A loaded mixed-layer cache, after checking every layer against the model's
    description (class, window, K/V dims, state shapes and dtypes, token count)."""
    classes, layers = backend.expected_layout(token_count)
    if [type(c).__name__ for c in cache] != classes:
        raise CacheFormatError("loaded cache layer classes do not match this model")
    for i, (c, want) in enumerate(zip(cache, layers or [], strict=True)):
        try:
            got = describe_layer(c)
            offset = getattr(c, "offset", token_count)
        except (AttributeError, TypeError, ValueError, IndexError):
            raise CacheFormatError(f"loaded cache layer {i} is malformed") from None
        if got != want or int(offset) != token_count:
            raise CacheFormatError(f"loaded cache layer {i} does not match its layout")
    out = PromptCache(cache)
    out.tokens = token_count
    return out


def _check_header(backend: MlxRuntime, header: Mapping[str, Any], token_count: int) -> None:
    meta = header.get("__metadata__")
    if not isinstance(meta, dict):
        raise CacheFormatError("cache file has no mlx-lm metadata")
    classes = sorted(v for k, v in meta.items() if k.startswith("1."))
    if backend.layers is not None:
        if classes != sorted(backend.expected_layout(token_count)[0]):
            raise CacheFormatError(f"cache file holds cache classes {classes[:4]}")
        return
    if classes != ["KVCache"] * backend.num_layers:
        raise CacheFormatError(f"cache file holds cache classes {classes[:4]}")
    st_dtype = _ST_DTYPES.get(backend.dtype)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape")
        if info.get("dtype") == st_dtype and (
                not isinstance(shape, list) or len(shape) != 4 or shape[2] != token_count):
            raise CacheFormatError(f"cache tensor {name!r} has shape {shape}")
