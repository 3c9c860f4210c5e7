"""Checking a cache handed to ``import_cache`` against its tokens: ``MlxBackend.check_import``.

Plain KV caches: every position recomputed (``full``) or four sampled ones, each compared
layer by layer within a relative tolerance of the dtype. Mixed layers (windows, recurrent
states, quantized KV): the layout must be the model's and every layer's arrays must match a
prefill of the tokens. A mismatch is a ValueError. Functions of the backend (``backend``,
whose ``mx`` does the arithmetic): no framework import here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..local.mlx_format import describe_layer, slice_caches
from .runtime import MlxRuntime

#: Relative tolerance of ``check_import``'s recomputed positions, by dtype.
_IMPORT_RTOL = {"float32": 1e-3, "float16": 3e-2, "bfloat16": 6e-2}


def check_import(backend: MlxRuntime, cache: Sequence[Any], tokens: Sequence[int], *,
                 full: bool = True) -> None:
    """Check that ``cache`` holds ``tokens`` for this model; ValueError on a mismatch.

    ``full`` (the default): prefill ``tokens`` again, step by step, and compare every
    layer's K/V at every position; ``full=False``: recompute four
    positions only, each on the cache cut just before it."""
    mx = backend.mx
    n = len(tokens)
    rtol = _IMPORT_RTOL.get(backend.dtype, 6e-2)
    if backend.layers is not None:  # states are a function of the whole prefix: recompute
        _check_layers_import(backend, cache, [int(t) for t in tokens], rtol)
        return
    if full:
        _check_all_positions(backend, cache, [int(t) for t in tokens], rtol)
        return
    for pos in sorted({0, n // 3, (2 * n) // 3, n - 1}):
        with backend.lock:
            work = slice_caches(cache, pos, backend.cache_mod.KVCache)
            backend.model(mx.array([[int(tokens[pos])]]), cache=work)
            mx.eval([c.state for c in work])
        for c, w in zip(cache, work, strict=True):
            for a, b in ((c.keys[..., pos, :], w.keys[..., pos, :]),
                         (c.values[..., pos, :], w.values[..., pos, :])):
                a32, b32 = a.astype(mx.float32), b.astype(mx.float32)
                scale = float(mx.abs(b32).max().item()) + 1e-6
                if float(mx.abs(a32 - b32).max().item()) > rtol * scale:
                    raise ValueError(f"position {pos} of the cache does not match token "
                                     f"{int(tokens[pos])} recomputed")


def _check_layers_import(backend: MlxRuntime, cache: Sequence[Any], tokens: list[int],
                         rtol: float) -> None:
    """Check a mixed-layer cache against ``tokens``: its layout (classes, windows, state
    shapes, quantization) must be the model's, and every layer's arrays must match a
    prefill of ``tokens`` by this model. A window or recurrent state depends on the
    whole prefix, so there is nothing to sample: ``check="sample"`` costs the same."""
    mx = backend.mx
    want_layers = backend.expected_layout(len(tokens))[1]
    try:
        got_layers = [describe_layer(c) for c in cache]
    except (AttributeError, TypeError, ValueError, IndexError):
        raise ValueError("a cache layer is empty or malformed") from None
    if got_layers != want_layers:
        raise ValueError("the cache's layers (classes, windows, state shapes, "
                         "quantization) are not this model's")
    work = backend.prefill(None, tokens)
    for i, (c, w) in enumerate(zip(cache, work, strict=True)):
        step = 0.0
        if type(c).__name__ == "QuantizedKVCache":  # one rounding step may flip
            step = max(float(mx.abs(a[1]).max().item()) for a in (w.keys, w.values))
        for a, b in zip(_compared(mx, c), _compared(mx, w), strict=True):
            m = min(a.shape[-2], b.shape[-2]) if a.ndim == 4 else None
            if m is not None:  # a window may hold extra older tokens: compare the latest
                a, b = a[..., a.shape[-2] - m:, :], b[..., b.shape[-2] - m:, :]
            if a.shape != b.shape:
                raise ValueError(f"layer {i} holds arrays of another shape than recomputed")
            a32, b32 = a.astype(mx.float32), b.astype(mx.float32)
            scale = float(mx.abs(b32).max().item()) + 1e-6
            if float(mx.abs(a32 - b32).max().item()) > rtol * scale + step:
                raise ValueError(f"layer {i} of the cache does not match the tokens "
                                 "recomputed")


def _check_all_positions(backend: MlxRuntime, cache: Sequence[Any], tokens: list[int],
                         rtol: float) -> None:
    mx = backend.mx
    work = backend.new_cache()
    for start in range(0, len(tokens), backend.prefill_step):
        end = min(start + backend.prefill_step, len(tokens))
        with backend.lock:
            backend.model(mx.array([tokens[start:end]]), cache=work)
            mx.eval([c.state for c in work])
        for c, w in zip(cache, work, strict=True):
            for a, b in ((c.keys, w.keys), (c.values, w.values)):
                got = a[..., start:end, :].astype(mx.float32)
                want = b[..., start:end, :].astype(mx.float32)
                err = mx.abs(got - want).max(axis=(0, 1, 3))
                scale = mx.abs(want).max(axis=(0, 1, 3)) + 1e-6
                bad = err > rtol * scale
                if bool(mx.any(bad).item()):
                    pos = start + int(mx.argmax(bad.astype(mx.int32)).item())
                    raise ValueError(f"position {pos} of the cache does not match token "
                                     f"{tokens[pos]} recomputed")


def _compared(mx: Any, c: Any) -> list[Any]:
    """The arrays of one cache layer that must equal a recomputation, in token order: K/V
    of the used tokens (dequantized for a quantized layer; a window in temporal order),
    or the recurrent state arrays."""
    name = type(c).__name__
    if name == "ArraysCache":
        return [a for a in c.cache if a is not None]
    if name == "QuantizedKVCache":
        return [mx.dequantize(*(x[..., :c.offset, :] for x in kv), group_size=c.group_size,
                              bits=c.bits) for kv in (c.keys, c.values)]
    if name == "RotatingKVCache":
        return [c._temporal_order(c.keys), c._temporal_order(c.values)]
    return [c.keys[..., :c.offset, :], c.values[..., :c.offset, :]]
