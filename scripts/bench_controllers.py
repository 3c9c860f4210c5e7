"""Benchmark the PyTorch controller: cold prefill vs disk hit (new process) vs incremental.

On the locally generated "small" Llama (a 4K-token prefill takes seconds on a CPU):

* cold: ``prepare`` on an empty store (prefill + serialize + verified commit), and the bare
  prefill (``backend.prefill``, no store) as the in-run reference;
* disk hit: a NEW process loads the model, then ``prepare`` is timed (read + verify +
  deserialize); the page cache is warm (the file was just written);
* incremental: the same prompt grown by ~10% (one more element), prepared in a fresh
  controller: base loaded from disk, trimmed, only the suffix prefilled, committed; the
  in-run reference is the same suffix prefilled onto an in-memory base (pure compute).
* decode: ``generate`` from a memory hit (transformers' ``model.generate`` continued from
  the cache, decision 1703) vs the hand-written greedy loop spoolctl used before, on the
  same cache; the tokens must be equal.
* ``--families`` (a run of its own): for one tiny model per cache family
  (``spoolctl.demo.tinyfamilies``: Gemma 3 sliding window, Jamba attention + Mamba, Mamba), cold
  ``prepare`` vs a disk hit in a new process at ``--tokens`` (decisions 2600, 2601), on
  PyTorch and, where mlx-lm is installed, on MLX: the same three models plus the tiny Llama
  with mlx-lm's quantized KV cache (``kv_bits=4``, group 32, from the first token; decision
  2604).
* render: ``prompt_tokens`` of the same params on a tiny model with a chat template,
  rendered through the template vs the plain format (decision 1702), and a memory-hit
  ``prepare`` (params normalisation, plan, handle bookkeeping).

Prints one JSON document. Goals: disk hit >= 10x faster than cold; incremental cost close
to the suffix's share of a cold prefill. Usage::

    .venv/bin/python scripts/bench_controllers.py [--tokens 4096] [--repeat 2] [--preset small]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORDS = (
    "pump", "valve", "tank", "level", "alarm", "ticket", "engineer", "seal", "pressure", "flow",
    "sensor", "log", "check", "open", "close", "start", "stop", "report", "supplier", "invoice",
    "clause", "audit", "notice", "board", "schedule", "store", "cache", "disk", "entry",
    "digest", "manifest", "object", "tensor", "token", "prompt", "model",
)


def element_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def build_params(backend, total_tokens: int, elements: int = 10):
    """Params with ``elements`` data elements of about total/elements tokens each."""
    from spoolctl.controllers import CachePrepareParams

    rng = random.Random(1)
    per = total_tokens // elements
    data = []
    for _ in range(elements):
        words = per
        text = element_text(rng, words)
        n = len(backend.tokenize_segments([text + "\n"])[0])
        text = element_text(rng, max(1, int(words * per / max(n, 1))))
        data.append(text)
    return CachePrepareParams(instructions=["You are a bench assistant."],
                              data=data)


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def reference_greedy(backend, cache, cached: int, ids: list[int], new: int) -> list[int]:
    """The greedy loop spoolctl used before decision 1703 (clone, prefill, argmax steps)."""
    import torch

    work = backend.clone(cache)
    logits = backend.forward(work, ids[cached:])
    out: list[int] = []
    while True:
        token = int(torch.argmax(logits).item())
        out.append(token)
        if token in backend.eos_ids or len(out) >= new:
            return out
        logits = backend.forward(work, [token])


def render_section(work: Path, tokens: int, repeat: int) -> dict:
    """Chat-template rendering vs plain, and a memory-hit prepare, on the tiny chat model."""
    from spoolctl.controllers import CachePrepareParams, LocalCacheController
    from spoolctl.controllers.pytorch import PyTorchBackend
    from spoolctl.demo.tinymodel import build_tiny_model

    backend = PyTorchBackend(build_tiny_model(work / "chat-model", "tiny-chat"))
    params = build_params(backend, tokens)
    plain = CachePrepareParams(instructions=params.instructions, data=params.data,
                               formatter_options={"template": "plain"})
    with LocalCacheController(backend, work / "render-store") as ctl:
        chat_s = median_time(lambda: ctl.prompt_tokens(params, "Q?"), repeat * 5)
        plain_s = median_time(lambda: ctl.prompt_tokens(plain, "Q?"), repeat * 5)
        ctl.prepare(params)
        hit_s = median_time(lambda: ctl.prepare(params), repeat * 20)
        return {"prompt_tokens_chat": len(ctl.prompt_tokens(params, "Q?")),
                "prompt_tokens_plain": len(ctl.prompt_tokens(plain, "Q?")),
                "render_chat_template_s": round(chat_s, 5),
                "render_plain_s": round(plain_s, 5),
                "chat_vs_plain": round(chat_s / plain_s, 2),
                "memory_hit_prepare_s": round(hit_s, 5)}


def cold_vs_disk_hit(controller: Any, backend: Any, params: Any, model_dir: Path,
                     stores: Path, repeat: int, spec: dict | None = None) -> dict:
    """Median cold ``prepare`` (a fresh store each time, so every run prefills) against a
    disk hit in a new process (``--child``, on the first of those stores)."""
    cold_times = []
    for i in range(repeat):
        with controller(backend, Path(f"{stores}{i}")) as ctl:
            t = time.perf_counter()
            h = ctl.prepare(params)
            cold_times.append(time.perf_counter() - t)
            assert h.source == "cold", h
            size = ctl.store.row(h.ref).size
    params_json = json.dumps({"model": params.model,
                              "instructions": [e.content for e in params.instructions],
                              "data": [e.content for e in params.data]})
    run = subprocess.run([sys.executable, __file__, "--repeat", str(repeat), "--child",
                          str(model_dir), f"{stores}0", params_json,
                          *(["--child-spec", json.dumps(spec)] if spec else [])],
                         capture_output=True, text=True, check=True)
    hit = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(hit["sources"]) == {"disk"}, hit
    cold_s = statistics.median(cold_times)
    return {"tokens": h.cached_tokens, "entry_bytes": size,
            "cold_prepare_s": round(cold_s, 4),
            "disk_hit_prepare_new_process_s": round(hit["seconds"], 4),
            "disk_hit_speedup_vs_cold": round(cold_s / hit["seconds"], 1)}


def families_section(work: Path, tokens: int, repeat: int) -> dict:
    """Cold prepare vs disk hit in a new process, per cache family, same prompt size."""
    from spoolctl.controllers.pytorch import PyTorchBackend, PyTorchCacheController
    from spoolctl.demo.tinyfamilies import FAMILIES, build_family_model

    out = {}
    for family in FAMILIES:
        model_dir = build_family_model(work / f"family-{family}", family)
        backend = PyTorchBackend(model_dir)
        params = build_params(backend, tokens)
        out[family] = {"kv_layout": backend.identity()["kv_layout"],
                       **cold_vs_disk_hit(PyTorchCacheController, backend, params, model_dir,
                                          work / family, repeat)}
    return out


#: The MLX rows of ``--families``: model family (``tiny``: the tiny Llama) and backend options.
MLX_FAMILIES = {"sliding": ("sliding", {}), "hybrid": ("hybrid", {}), "ssm": ("ssm", {}),
                "quantized": ("tiny", {"kv_bits": 4, "kv_group_size": 32,
                                       "quantized_kv_start": 0})}


def mlx_families_section(work: Path, tokens: int, repeat: int) -> dict:
    """``families_section`` on mlx-lm (skipped, with the reason, where it is not installed)."""
    try:
        from spoolctl.controllers.mlx import MlxBackend, MlxCacheController
    except ImportError as exc:
        return {"skipped": str(exc)}
    try:
        import mlx.core  # noqa: F401
    except (ImportError, OSError) as exc:
        return {"skipped": f"mlx is not usable here ({exc})"}
    from spoolctl.demo.tinyfamilies import build_family_model
    from spoolctl.demo.tinymodel import build_tiny_model

    out = {}
    for name, (family, kv) in MLX_FAMILIES.items():
        model_dir = build_tiny_model(work / "mlx-tiny", "tiny") if family == "tiny" else \
            build_family_model(work / f"family-{family}", family)
        backend = MlxBackend(model_dir, **kv)
        params = build_params(backend, tokens)
        backend.generate(None, 0, backend.tokenize_segments(["warm up"])[0], 1)
        out[name] = {"cache_layers": backend.identity().get("cache_layers", "KVCache"),
                     **cold_vs_disk_hit(MlxCacheController, backend, params, model_dir,
                                        work / f"mlx-{name}", repeat,
                                        {"framework": "mlx", "kv": kv})}
    return out


def child(model: str, root: str, params_json: str, repeat: int, spec_json: str = "{}") -> None:
    from spoolctl.controllers import CachePrepareParams
    from spoolctl.controllers.pytorch import (
        PyTorchBackend,
        PyTorchCacheController,
        quiet_frameworks,
    )

    spec = json.loads(spec_json)
    quiet_frameworks()
    if spec.get("framework") == "mlx":
        from spoolctl.controllers.mlx import MlxBackend, MlxCacheController

        backend, controller = MlxBackend(model, **spec.get("kv", {})), MlxCacheController
    else:
        backend, controller = PyTorchBackend(model), PyTorchCacheController
    backend.identity()  # hashed once per process, before timing
    params = CachePrepareParams(**json.loads(params_json))
    times, sources = [], []
    for _ in range(repeat):
        with controller(backend, root) as ctl:  # empty memory each time
            t = time.perf_counter()
            h = ctl.prepare(params)
            times.append(time.perf_counter() - t)
            sources.append(h.source)
    print(json.dumps({"seconds": statistics.median(times), "sources": sources}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--families", action="store_true",
                    help="only the per-family rows (sliding window, hybrid, Mamba; on MLX also "
                         "the quantized KV cache)")
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "ROOT", "PARAMS"), help=argparse.SUPPRESS)
    ap.add_argument("--child-spec", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child, repeat=args.repeat + 1, spec_json=args.child_spec)
        return

    import torch

    if args.families:
        work = Path(os.path.realpath(tempfile.mkdtemp(prefix="spoolctl-bench-")))
        try:
            print(json.dumps({"bench": "controllers/families",
                              "torch_threads": torch.get_num_threads(),
                              "repeat": args.repeat,
                              "families": families_section(work, args.tokens, args.repeat),
                              "mlx_families": mlx_families_section(work, args.tokens,
                                                                   args.repeat)},
                             indent=2))
        finally:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
        return

    from spoolctl.controllers import CachePrepareParams
    from spoolctl.controllers.pytorch import (
        PyTorchBackend,
        PyTorchCacheController,
        quiet_frameworks,
    )
    from spoolctl.demo.tinymodel import build_tiny_model

    quiet_frameworks()
    work = Path(os.path.realpath(tempfile.mkdtemp(prefix="spoolctl-bench-")))
    model_dir = Path(args.model_dir) if args.model_dir else work / "model"
    build_tiny_model(model_dir, args.preset)
    backend = PyTorchBackend(model_dir)
    full = build_params(backend, args.tokens)
    base = CachePrepareParams(model=full.model, instructions=full.instructions,
                              data=full.data[:-1])
    ids = [t for s in backend.tokenize_segments(
        [f"{e.content}\n" for e in (*full.instructions, *full.data)]) for t in s]
    backend.generate(None, 0, ids[:64], 1)  # warm-up

    # Reference: the bare prefill, no store.
    bare_s = median_time(lambda: backend.prefill(backend.new_cache(), ids), args.repeat)
    # Cold prepare: prefill + serialize + verified commit, each on an empty store.
    cold_times = []
    for i in range(args.repeat):
        with PyTorchCacheController(backend, work / f"cold{i}") as ctl:
            t = time.perf_counter()
            h = ctl.prepare(full)
            cold_times.append(time.perf_counter() - t)
            assert h.source == "cold", h
            entry_bytes = ctl.store.row(h.ref).size
    cold_s = statistics.median(cold_times)
    # Disk hit in a new process.
    params_json = json.dumps({"model": full.model,
                              "instructions": [e.content for e in full.instructions],
                              "data": [e.content for e in full.data]})
    out = subprocess.run([sys.executable, __file__, "--repeat", str(args.repeat), "--child",
                          str(model_dir), str(work / "cold0"), params_json],
                         capture_output=True, text=True, check=True)
    hit = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(hit["sources"]) == {"disk"}, hit
    # Incremental: base committed, then the full prompt in a fresh controller.
    inc_times, written = [], 0
    for i in range(args.repeat):
        root = work / f"inc{i}"
        with PyTorchCacheController(backend, root) as ctl:
            ctl.prepare(base)
        with PyTorchCacheController(backend, root) as ctl:
            t = time.perf_counter()
            h = ctl.prepare(full)
            inc_times.append(time.perf_counter() - t)
            assert h.source == "incremental", h
            written = h.written_tokens
    inc_s = statistics.median(inc_times)
    # Reference for the incremental run: the same suffix prefilled onto an in-memory base
    # (pure compute: the suffix still attends to the whole base context).
    base_cache = backend.prefill(backend.new_cache(), ids[:len(ids) - written])
    suffix_s = median_time(lambda: backend.prefill(backend.clone(base_cache),
                                                   ids[len(ids) - written:]), args.repeat)
    # Decode from a memory hit: the controller (model.generate) vs the old hand loop.
    question, new = "Question: which valve stays shut?", 32
    with PyTorchCacheController(backend, work / "cold0") as ctl:
        h = ctl.prepare(full)
        prompt = ctl.prompt_tokens(h, question)
        ctl.generate(h, question, new)  # the first use reports the prepare; warm-up
        gen_s = median_time(lambda: ctl.generate(h, question, new), args.repeat)
        ours = ctl.generate(h, question, new).tokens
        cache = ctl.restore(h).cache
    loop_s = median_time(lambda: reference_greedy(backend, cache, h.cached_tokens, prompt, new),
                         args.repeat)
    same = reference_greedy(backend, cache, h.cached_tokens, prompt, new) == ours
    render = render_section(work, args.tokens, args.repeat)
    doc = {
        "bench": "controllers/pytorch",
        "model": {"preset": args.preset, "dtype": "float32", "device": "cpu",
                  "torch_threads": torch.get_num_threads()},
        "tokens": len(ids),
        "entry_bytes": entry_bytes,
        "repeat": args.repeat,
        "bare_prefill_s": round(bare_s, 4),
        "cold_prepare_s": round(cold_s, 4),
        "disk_hit_prepare_new_process_s": round(hit["seconds"], 4),
        "disk_hit_speedup_vs_cold": round(cold_s / hit["seconds"], 1),
        "incremental_prepare_s": round(inc_s, 4),
        "incremental_suffix_tokens": written,
        "suffix_fraction": round(written / len(ids), 3),
        "incremental_fraction_of_cold": round(inc_s / cold_s, 3),
        "bare_suffix_prefill_s": round(suffix_s, 4),
        "incremental_store_overhead_s": round(inc_s - suffix_s, 4),
        "goal_disk_hit_10x": cold_s / hit["seconds"] >= 10,
        "decode": {"new_tokens": len(ours), "generate_s": round(gen_s, 4),
                   "reference_greedy_loop_s": round(loop_s, 4),
                   "generate_vs_loop": round(gen_s / loop_s, 2), "same_tokens": same},
        "render": render,
    }
    print(json.dumps(doc, indent=2))
    import shutil

    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
