"""Pure parts of the mlx-lm adapter: the cache format id, the model digest, KV slicing,
and the bounds-checked safetensors header parser. No mlx import (``mlx/backend.py`` adapts
mlx-lm; ``mlx/vlm_backend.py`` shares these)."""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from spoolctl.errors import ConfigError
from spoolctl.store import Hasher

from .safetensors_layout import tiling_error

_MAX_HEADER = 16 << 20


class CacheFormatError(ValueError):
    """Stored cache bytes that this mlx-lm cannot use (another cache format version,
    another model shape, malformed file). Always a cache miss, never a crash.

    A ValueError, not a SpoolError, on purpose: the local engine treats a SpoolError
    from a backend as transient I/O (keep the entry, retry later) but a ValueError as
    a defect of the entry (quarantine it, so the key is rebuilt instead of staying a
    permanent miss). Entries of other mlx-lm versions live in another namespace (the
    version is part of the identity), so only an inconsistent entry gets here.
    """

    def __init__(self, message: str, *, fix: str = "nothing to do: it is a cache miss and "
                 "the entry is rebuilt"):
        super().__init__(f"{message}: {fix}")
        self.message = message
        self.fix = fix


def cache_format(mlx_lm_version: str) -> str:
    """The on-disk cache format id for an mlx-lm version.

    mlx-lm changed its prompt-cache file layout between minor releases (0.31 files
    do not load in 0.32), and patch releases have kept it, so the format is named
    by the major.minor series. A stored entry is reused only under the same id.
    """
    parts = mlx_lm_version.split(".")
    series = ".".join(parts[:2]) if len(parts) >= 2 else mlx_lm_version
    return f"mlx-lm-prompt-cache/{series}"


def dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def model_digest(model_dir: Path) -> str:
    """Content digest of a model directory: every top-level regular file (weights,
    config, tokenizer), by name and bytes. Hidden files are skipped.

    Hashing the content (not the path or mtime) means a copied model keeps its
    caches and a changed weight file never reuses a stale KV cache.
    """
    h = Hasher()
    files = sorted(p for p in model_dir.iterdir()
                   if not p.name.startswith(".") and p.is_file())
    if not files:
        raise ConfigError("model directory holds no files", path=model_dir,
                          fix="pass a transformers-format model directory")
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    for p in files:
        name = p.name.encode()
        h.update(len(name).to_bytes(8, "big"))
        h.update(name)
        h.update(p.stat().st_size.to_bytes(8, "big"))
        with open(p, "rb") as f:
            while n := f.readinto(buf):
                h.update(view[:n])
    return h.hexdigest()


def slice_caches(cache: Sequence[Any], keep: int, make: Callable[[], Any]) -> list[Any]:
    """New ``KVCache`` objects (made by ``make``) holding the first ``keep`` tokens of each
    layer of ``cache``. Slicing makes new arrays, so writes into the copy (mlx assigns into
    its buffers in place) never reach the original. The caller checks ``keep``."""
    out = []
    for c in cache:
        n = make()
        if keep > 0:
            n.keys = c.keys[..., :keep, :]
            n.values = c.values[..., :keep, :]
            n.offset = keep
        out.append(n)
    return out


def slice_layer(c: Any, keep: int) -> Any:
    """A new ``KVCache`` or ``QuantizedKVCache`` holding the first ``keep`` tokens of ``c``
    (new arrays: mlx-lm's in-place writes into the copy never reach ``c``). A quantized
    layer is quantized per token (groups run along the head dimension), so its first
    ``keep`` tokens are exactly what a cache of those tokens alone holds."""
    if type(c).__name__ == "QuantizedKVCache":
        n = type(c)(group_size=c.group_size, bits=c.bits)
        if keep > 0:
            n.keys = tuple(a[..., :keep, :] for a in c.keys)
            n.values = tuple(a[..., :keep, :] for a in c.values)
            n.offset = keep
        return n
    n = type(c)()
    if keep > 0:
        n.keys = c.keys[..., :keep, :]
        n.values = c.values[..., :keep, :]
        n.offset = keep
    return n


class NamedBytesIO(io.BytesIO):
    # mlx.core.load picks the file format from the name's suffix.
    name = "prompt_cache.safetensors"


def safetensors_header(data: memoryview) -> dict[str, Any]:
    """Parse and bounds-check a safetensors header (pure Python, before mlx sees it)."""
    if len(data) < 8:
        raise CacheFormatError("cache file is shorter than a safetensors header")
    (size,) = struct.unpack("<Q", data[:8])
    if size > min(_MAX_HEADER, len(data) - 8):
        raise CacheFormatError("cache file header length is out of range")
    try:
        header = json.loads(bytes(data[8:8 + size]))
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: deep nesting
        raise CacheFormatError("cache file header is not JSON") from None
    if not isinstance(header, dict):
        raise CacheFormatError("cache file header is not an object")
    body = len(data) - 8 - size
    spans: list[tuple[int, int]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= body):
            raise CacheFormatError(f"cache tensor {name!r} has invalid offsets")
        spans.append((offsets[0], offsets[1]))
    if (why := tiling_error(spans, body)) is not None:
        raise CacheFormatError(f"cache file body is malformed: {why}")
    return header


class PromptCache(list):
    """mlx-lm's list of per-layer caches, plus the token count: an ``ArraysCache``
    (Mamba state) does not count the tokens it has seen."""

    tokens: int = 0


def copy_state(mx: Any, state: Any) -> Any:
    """A cache state (arrays, scalars, nested lists/tuples) with every array copied."""
    if isinstance(state, mx.array):
        return mx.array(state)
    if isinstance(state, (list, tuple)):
        return type(state)(copy_state(mx, s) for s in state)
    return state


def describe_layer(c: Any) -> dict[str, Any]:
    """What one mlx-lm cache layer holds, without its token count: class, window, K/V
    dims, state shapes and dtypes."""
    name = type(c).__name__
    if name == "ArraysCache":
        return {"class": name, "states": [None if a is None else
                                          {"shape": list(a.shape[1:]),
                                           "dtype": dtype_name(a.dtype)} for a in c.cache]}
    if name == "QuantizedKVCache":  # keys/values: (packed ints, scales, biases)
        g = int(c.group_size)
        return {"class": name, "kv_heads": int(c.keys[0].shape[1]),
                "k_head_dim": int(c.keys[1].shape[3]) * g,
                "v_head_dim": int(c.values[1].shape[3]) * g,
                "dtype": dtype_name(c.keys[1].dtype), "bits": int(c.bits), "group_size": g}
    d: dict[str, Any] = {"class": name, "kv_heads": int(c.keys.shape[1]),
                         "k_head_dim": int(c.keys.shape[3]),
                         "v_head_dim": int(c.values.shape[3]),
                         "dtype": dtype_name(c.keys.dtype)}
    if name == "RotatingKVCache":
        d["window"], d["keep"] = int(c.max_size), int(c.keep)
    return d


def layers_summary(layers: list[dict[str, Any]] | None) -> str:
    """Compact identity string of a mixed-layer layout (one code per layer)."""
    codes = []
    for d in layers or []:
        if d["class"] == "ArraysCache":
            codes.append("A" + "+".join("-" if s is None else "x".join(map(str, s["shape"]))
                                        for s in d["states"]))
        elif d["class"] == "QuantizedKVCache":
            codes.append(f"Q{d['bits']}g{d['group_size']}h{d['kv_heads']}d{d['k_head_dim']}")
        else:
            codes.append(("R" + str(d["window"]) if "window" in d else "K")
                         + f"h{d['kv_heads']}d{d['k_head_dim']}")
    return ",".join(codes)
