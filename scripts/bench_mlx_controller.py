#!/usr/bin/env python3
"""MLX controller: time to first token cold vs restored from the store, next to mlx-lm's
own prompt-cache file (``save_prompt_cache``/``load_prompt_cache``), measured in one run.

For each prompt size: a cached document prefix of about N tokens plus a short question.

* ``cold_s``: greedy first token with no cache (the full prompt prefilled).
* ``prepare_cold_s``: ``MlxCacheController.prepare`` on an empty store (prefill + commit).
* ``restart_ttft_s``: a fresh controller and backend object (as after a restart) on the
  same store: ``prepare`` (lookup, verified read, deserialize) + first token.
* ``mlx_lm_file_ttft_s``: the peer: ``load_prompt_cache`` of a file written by mlx-lm's
  ``save_prompt_cache`` (no integrity check, whole 256-token-step buffer) + first token.

Prints JSON. ``python scripts/bench_mlx_controller.py [--model DIR] [--sizes 512 1024]``
(default model: the locally generated "small" Llama, built in a temp dir; mlx on
Linux CPU computes slowly, so the default sizes are modest).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from spoolctl.controllers import CachePrepareParams
from spoolctl.controllers.contract import render_segments
from spoolctl.controllers.mlx import MlxBackend, MlxCacheController

SENTENCES = [
    "The spool store keeps prompt caches on local disk with integrity.",
    "Operators pay again and again to prefill long prefixes.",
    "A manifest describes every entry; objects are named by their digest.",
    "Crash safety means an entry is complete or absent after a power cut.",
]
QUESTION = "Question: what does a manifest describe?"


def document(backend: MlxBackend, tokens: int) -> str:
    """Text of about ``tokens`` tokens (numbered sentences, so it does not compress away)."""
    parts: list[str] = []
    per = max(1, len(backend.tokenize_segments([SENTENCES[0] + " 1."])[0]))
    for i in range(tokens // per + 1):
        parts.append(f"{SENTENCES[i % len(SENTENCES)]} {i}.")
    text = " ".join(parts)
    while len(backend.tokenize_segments([text])[0]) > tokens:
        text = text[: int(len(text) * 0.97)]
    return text


def first_token_time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_size(model: Path, backend: MlxBackend, size: int, repeat: int, work: Path) -> dict:
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    p = CachePrepareParams(data=[document(backend, size)])
    ids = [t for s in backend.tokenize_segments([*render_segments(p), QUESTION]) for t in s]
    colds, prepares, restarts, peers = [], [], [], []
    entry_bytes = peer_bytes = cached = 0
    for r in range(repeat):
        colds.append(first_token_time(lambda: backend.generate(None, 0, ids, 1)))
        root = work / f"store-{size}-{r}"
        with MlxCacheController(backend, root) as ctl:
            t = time.perf_counter()
            h = ctl.prepare(p)
            prepares.append(time.perf_counter() - t)
            cached = h.cached_tokens
            entry_bytes = ctl.store.totals().bytes
        fresh = MlxBackend(model)  # a restarted process has no cache in memory

        def restored(fresh=fresh, root=root):
            with MlxCacheController(fresh, root) as ctl:
                h = ctl.prepare(p)
                assert h.source == "disk", h.source
                ctl.generate(h, QUESTION, 1)

        restarts.append(first_token_time(restored))
        # Peer: mlx-lm's own file of the same prefix (what `mlx_lm.cache_prompt` users keep).
        peer = work / f"peer-{size}-{r}.safetensors"
        save_prompt_cache(str(peer), backend.prefill(None, ids[:cached]))
        peer_bytes = peer.stat().st_size

        def peer_ttft(peer=peer, fresh=fresh, cached=cached):
            cache = load_prompt_cache(str(peer))
            fresh.generate(cache, cached, ids, 1)

        peers.append(first_token_time(peer_ttft))
    med = statistics.median
    return {
        "prompt_tokens": len(ids), "cached_tokens": cached,
        "cold_s": round(med(colds), 4), "prepare_cold_s": round(med(prepares), 4),
        "restart_ttft_s": round(med(restarts), 4), "mlx_lm_file_ttft_s": round(med(peers), 4),
        "speedup_vs_cold": round(med(colds) / med(restarts), 2),
        "entry_bytes": entry_bytes, "mlx_lm_file_bytes": peer_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="model directory (default: generated 'small')")
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="spoolctl-bench-mlx-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from spoolctl.demo.tinymodel import build_tiny_model

            model = build_tiny_model(work / "small", "small")
        backend = MlxBackend(model)
        backend.generate(None, 0, backend.tokenize_segments(["warm up"])[0], 2)
        results = [bench_size(model, backend, n, args.repeat, work) for n in args.sizes]
        ident = backend.identity()
    print(json.dumps({"bench": "mlx_controller", "model": str(args.model or "generated small"),
                      "mlx_lm": ident["mlx_lm_version"], "mlx": ident["mlx_version"],
                      "device": ident["device"], "repeat": args.repeat, "results": results},
                     indent=2))


if __name__ == "__main__":
    main()
