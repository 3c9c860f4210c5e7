#!/usr/bin/env python3
"""mlx-vlm controller: first token cold vs restored from the store, next to mlx-vlm's own
exact-snapshot directory (``DiskBlockStore``), all measured in one run.

For each prompt size and mode (text-only, one image): a cached document prefix of about
N tokens (the image, if any, in front of it) plus a short question.

* ``cold_s``: greedy first token with no cache (whole prompt prefilled, image encoded).
* ``prepare_cold_s``: ``MlxVlmCacheController.prepare`` on an empty store (prefill+commit).
* ``restart_ttft_s``: a fresh controller (nothing in memory, as after a restart) on the
  same store: ``prepare`` (lookup, verified read, snapshot load, image identity check)
  + first token.
* ``mlx_vlm_exact_ttft_s``: the peer: ``DiskBlockStore.load_exact_cache`` of a snapshot
  mlx-vlm wrote itself (no integrity check, no spool) + first token.

Prints JSON. ``python scripts/bench_mlx_vlm.py [--model DIR] [--sizes 256 1024]``
(default model: the locally generated tiny Qwen2-VL, built in a temp dir).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from spoolctl.controllers import CachePrepareParams, Element
from spoolctl.controllers.local.vlm_prompt import render_vlm
from spoolctl.controllers.mlx.vlm import MlxVlmBackend, MlxVlmCacheController, VlmSnapshot

SENTENCES = ["The spool store keeps prompt caches on local disk with integrity.",
             "A manifest describes every entry; objects are named by their digest."]
QUESTION = "assistant: The picture shows"


def document(backend: MlxVlmBackend, tokens: int) -> str:
    parts, i = [], 0
    text = ""
    while len(backend.encode(text, [])["ids"]) < tokens:
        parts.append(f"{SENTENCES[i % 2]} {i}.")
        i += 1
        text = " ".join(parts)
    return text


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench(backend: MlxVlmBackend, model: Path, size: int, image: Path | None, repeat: int,
          work: Path) -> dict:
    from mlx_vlm.apc import DiskBlockStore

    p = CachePrepareParams(model=str(model), instructions=[Element("You describe pictures.",
                                                                   role="system")],
                           data=[Element(document(backend, size), role="user")],
                           images=[{"source": str(image), "before": 1}] if image else [])
    imgs = backend.load_images(p.images, None)
    full = backend.encode(render_vlm(p, p.images, backend.placeholder, include_volatile=True,
                                     prompt=QUESTION), imgs)
    cold = [timed(lambda: backend.generate(None, full, imgs, 1)) for _ in range(repeat)]
    root = work / f"store-{size}-{'img' if image else 'txt'}"
    with MlxVlmCacheController(backend, root) as ctl:
        prepare_cold = timed(lambda: ctl.prepare(p))
        cached_tokens = ctl.prepare(p).cached_tokens
    restart, reused = [], []
    for _ in range(repeat):
        with MlxVlmCacheController(backend, root) as ctl:
            t = time.perf_counter()
            res = ctl.generate(ctl.prepare(p), QUESTION, 1)
            restart.append(time.perf_counter() - t)
            reused.append(res.usage.cache_read_tokens)
    # Peer: mlx-vlm's own exact snapshot directory, written and read by mlx-vlm.
    prefix_text = render_vlm(p, p.images, backend.placeholder, include_volatile=False)
    snap = backend.prefill(backend.encode(prefix_text, imgs), imgs, 7)
    peer_dir = work / f"peer-{size}-{'img' if image else 'txt'}"
    store = DiskBlockStore(peer_dir, "bench")
    store.save_exact_cache(1234, list(snap.token_ids), 7, snap.cache, synchronous=True)
    store.close()
    peer = []
    for _ in range(repeat):
        t = time.perf_counter()
        s = DiskBlockStore(peer_dir, "bench")
        ids, extra, cache = s.load_exact_cache(1234)
        s.close()
        backend.generate(VlmSnapshot(cache, tuple(ids), extra), full, imgs, 1)
        peer.append(time.perf_counter() - t)
    med = statistics.median
    return {"prompt_tokens": len(full["ids"]), "cached_tokens": cached_tokens,
            "images": len(imgs), "cold_s": round(med(cold), 4),
            "prepare_cold_s": round(prepare_cold, 4), "restart_ttft_s": round(med(restart), 4),
            "restart_cache_read_tokens": min(reused),
            "mlx_vlm_exact_ttft_s": round(med(peer), 4),
            "speedup_vs_cold": round(med(cold) / med(restart), 2),
            "vs_peer": round(med(restart) / med(peer), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-mlx-vlm-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from spoolctl.demo.tinyvlm import build_tiny_vlm

            model = build_tiny_vlm(work / "tiny-qwen2-vl")
        from PIL import Image

        image = work / "image.png"
        Image.new("RGB", (56, 56), (200, 40, 40)).save(image)
        backend = MlxVlmBackend(model)
        rows = [{"mode": "image" if img else "text", "size": size,
                 **bench(backend, model, size, img, args.repeat, work)}
                for size in args.sizes for img in (None, image)]
    print(json.dumps({"model": str(args.model or "tiny-qwen2-vl (generated)"),
                      "mlx_vlm": backend.mlx_vlm_version, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
