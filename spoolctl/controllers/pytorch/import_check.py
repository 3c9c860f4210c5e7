"""Checking a cache handed to ``import_cache`` against its tokens:
``PyTorchBackend.check_import``; a mismatch is a ValueError."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import layers as hf_layers
from .runtime import TorchRuntime

#: Relative tolerance of recomputed positions, by dtype (a batched and a one-token forward
#: differ by rounding; a cache of another token differs by O(1)).
_IMPORT_RTOL = {"float32": 1e-3, "float16": 3e-2, "bfloat16": 6e-2}
IMPORT_CHECKS = 4  # positions an imported cache's "sample" check recomputes


def check_import(backend: TorchRuntime, cache: Any, tokens: Sequence[int], *,
                 full: bool = True) -> None:
    """Check that ``cache`` holds ``tokens`` for this model; ValueError on a mismatch.

    ``full`` (the default): prefill ``tokens`` again, in chunks, and compare every
    layer's K/V at every position -- a changed token anywhere changes at least its own
    position's K/V; costs one prefill and a second cache's memory.
    ``full=False``: recompute only four positions (first, two inside, last), each on the
    cache trimmed just before it -- catches another template, model or dtype, not a
    token changed elsewhere."""
    n = len(tokens)
    rtol = _IMPORT_RTOL.get(str(backend.dtype).removeprefix("torch."), 6e-2)
    if backend.layers is not None:  # states are a function of the whole prefix: recompute
        _check_states(backend, cache, list(tokens), rtol)
        return
    kv = backend.kv_pairs(cache)
    if full:
        _check_all_positions(backend, kv, list(tokens), rtol)
        return
    for pos in sorted({0, n // 3, (2 * n) // 3, n - 1})[:IMPORT_CHECKS]:
        work = backend.new_cache()
        for i, (k, v) in enumerate(kv if pos else ()):
            work.update(k[:, :, :pos].clone(), v[:, :, :pos].clone(), i)
        backend.forward(work, [int(tokens[pos])])
        for (k, v), (k2, v2) in zip(kv, backend.kv_pairs(work), strict=True):
            for a, b in ((k[:, :, pos], k2[:, :, pos]), (v[:, :, pos], v2[:, :, pos])):
                scale = float(b.abs().max()) + 1e-6
                if float((a.float() - b.float()).abs().max()) > rtol * scale:
                    raise ValueError(f"position {pos} of the cache does not match token "
                                     f"{int(tokens[pos])} recomputed")


def _check_states(backend: TorchRuntime, cache: Any, tokens: list[int], rtol: float) -> None:
    """Prefill ``tokens`` again and compare every tensor of every layer."""
    work = backend.prefill(backend.new_cache(), tokens)
    got = hf_layers.tensors(cache, backend.layers or [], len(tokens))
    want = hf_layers.tensors(work, backend.layers or [], len(tokens))
    for name, b in want.items():
        a = got[name].float()
        scale = float(b.float().abs().max()) + 1e-6
        if float((a - b.float()).abs().max()) > rtol * scale:
            raise ValueError(f"cache state {name} does not match the tokens recomputed")


def _check_all_positions(backend: TorchRuntime, kv: list[tuple[Any, Any]], tokens: list[int],
                         rtol: float) -> None:
    """Prefill ``tokens`` chunk by chunk and compare each chunk's positions at once."""
    torch = backend.torch
    work = backend.new_cache()
    for start in range(0, len(tokens), backend.prefill_chunk):
        end = min(start + backend.prefill_chunk, len(tokens))
        backend.forward(work, tokens[start:end])
        for (k, v), (k2, v2) in zip(kv, backend.kv_pairs(work), strict=True):
            for a, b in ((k, k2), (v, v2)):
                got = a[:, :, start:end].to(b.device).float()
                want = b[:, :, start:end].float()
                # per position: the largest error against that position's own scale
                err = (got - want).abs().amax(dim=(0, 1, 3))
                scale = want.abs().amax(dim=(0, 1, 3)) + 1e-6
                bad = torch.nonzero(err > rtol * scale)
                if len(bad):
                    pos = start + int(bad[0, 0])
                    raise ValueError(f"position {pos} of the cache does not match token "
                                     f"{tokens[pos]} recomputed")
