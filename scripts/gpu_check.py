"""GPU check of the KV data path in one command: torch + spoolctl only (no vLLM, no network).

Runs wherever ``torch.cuda.is_available()`` (and on CPU with ``--device cpu``, which CI
does with ``--small``). Three parts, one JSON document on stdout:

1. ``layouts``: for every KV layout vLLM allocates (``LBHNC LBNHC LHBNC BLHNC BLNHC
   BHLNC``) and page shape (attention, MLA latent, packed quantised, kernel-split
   blocks), vLLM-shaped caches are built on the device (``layouts.place`` +
   ``view_declared``, proven equal to vLLM's allocator in tests/connector/test_kv_layouts.py) and
   filled with random bytes; a chunk is captured, committed to a spool store (verified
   commit), read back verified, restored into fresh blocks of a second cache, and the
   destination must equal a reference made with plain tensor indexing on the device,
   byte for byte (copied blocks identical, every other byte untouched).
2. ``copy``: capture and restore of one chunk through pinned and through pageable host
   buffers, as ratios of a plain ``tensor.copy_`` of the same bytes (one contiguous
   device tensor to/from a pinned host tensor), plus the host time to issue a capture
   (the copy runs on its own stream). Medians of ``--repeat`` runs.
3. ``controller``: the PyTorch prompt-cache controller with a locally generated model
   (random weights; default a ~1B-parameter Llama shape in bfloat16: hidden 2048,
   16 layers, 32 heads / 8 KV heads, MLP 8192) on the device: cold ``prepare`` (prefill +
   serialize + verified commit) vs a disk hit in a NEW process (model loaded first, then
   ``prepare`` timed), at 8K and 32K prompt tokens; the greedy tokens after the hit must
   equal the cold run's.

Exit status 0 when every check passed, 1 otherwise. Usage::

    python scripts/gpu_check.py                       # CUDA host, full sizes
    python scripts/gpu_check.py --device cpu --small  # CI-sized, on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
WORDS = ("pump", "valve", "tank", "level", "alarm", "ticket", "engineer", "seal", "pressure",
         "flow", "sensor", "log", "check", "report", "supplier", "invoice", "clause", "audit",
         "notice", "schedule", "store", "cache", "disk", "entry", "digest", "manifest")


def sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_info(torch, device) -> dict:
    info = {"type": device.type, "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    else:
        info.update(name="cpu", threads=torch.get_num_threads())
    return info


# -- 1. every layout: capture -> verified commit -> verified read -> restore ------------------

def page_shapes(small: bool) -> dict[str, dict]:
    """Page shapes as vLLM's specs make them (H, N, C bytes, dtype)."""
    return {
        # flash-attn / Triton / FlashInfer / CPU: K and V of one head per state.
        "attention": {"heads": 2 if small else 8, "states": 16,
                      "content_bytes": (64 if small else 256) * 2, "dtype": "bfloat16"},
        # MLA latent cache (kv_lora_rank 512 + rope 64), one head slot.
        "mla": {"heads": 1, "states": 16 if small else 64, "content_bytes": 576 * 2,
                "dtype": "bfloat16"},
        # Packed fp8/int8 page with per-head scales in the content.
        "packed": {"heads": 2 if small else 8, "states": 16, "content_bytes": 72 * 2,
                   "dtype": "uint8"},
    }


def check_layouts(torch, device, small: bool, work: Path) -> list[dict]:
    from spoolctl.connector.kv import layouts
    from spoolctl.connector.kv.kvio import BufferPool, PagedKV, view_declared
    from spoolctl.store import Store

    store = Store.open(work / "layouts-store", create=True)
    pin = device.type == "cuda"
    results = []
    names = [f"model.layers.{i}.self_attn.attn" for i in range(3 if small else 8)]
    num_blocks, per_chunk = (12, 4) if small else (64, 16)
    rng = random.Random(0)
    for layout in LAYOUTS:
        for page_name, page in page_shapes(small).items():
            ratios = (1, 2) if not layout.startswith("B") and layout != "LHBNC" else (1,)
            for ratio in ratios:
                dtype = getattr(torch, page["dtype"])
                nbytes, decls = layouts.place(
                    names, layout=layout, num_blocks=num_blocks, heads=page["heads"],
                    states=page["states"], content_bytes=page["content_bytes"],
                    itemsize=dtype.itemsize, dtype=page["dtype"])
                src_raw = torch.randint(-128, 127, (nbytes,), dtype=torch.int8, device=device)
                dst_raw = torch.randint(-128, 127, (nbytes,), dtype=torch.int8, device=device)
                src = {n: view_declared(src_raw, d, ratio) for n, d in decls.items()}
                dst = {n: view_declared(dst_raw, d, ratio) for n, d in decls.items()}
                a = PagedKV(src, num_blocks=num_blocks, blocks_per_chunk=per_chunk,
                            declared=decls, asynchronous=True)
                b = PagedKV(dst, num_blocks=num_blocks, blocks_per_chunk=per_chunk,
                            declared=decls, asynchronous=True)
                ids = rng.sample(range(num_blocks), 2 * per_chunk)
                src_ids, dst_ids = ids[:per_chunk], ids[per_chunk:]
                # Reference: plain tensor indexing on the device, on a copy of dst.
                expect_raw = dst_raw.clone()
                expect = {n: view_declared(expect_raw, d, ratio) for n, d in decls.items()}
                for n in names:
                    e = expect[n].unflatten(0, (num_blocks, ratio)).view(torch.uint8)
                    s = src[n].unflatten(0, (num_blocks, ratio)).view(torch.uint8)
                    for i, j in zip(src_ids, dst_ids, strict=True):
                        e[j] = s[i]
                pool = BufferPool(a.chunk_bytes, slots=2, pin=pin)
                out, into = pool.get(), pool.get()
                a.capture(src_ids, out).wait()
                key = f"{layout}-{page_name}-r{ratio}"
                store.put(kind="vllm", namespace="gpu-check", key=key,
                          objects={"kv": memoryview(out.numpy())}, meta={"layout": key})
                manifest = store.lookup("vllm", "gpu-check", key)
                store.read(manifest, "kv", into=memoryview(into.numpy()))  # verified
                handle = b.restore(into, dst_ids)
                pool.put(into, after=handle)
                pool.put(out)
                sync(torch, device)
                same = bool(torch.equal(dst_raw, expect_raw))
                pool.close()
                g = a.layers[0]
                results.append({"layout": layout, "page": page_name, "kernel_blocks": ratio,
                                "chunk_bytes": a.chunk_bytes,
                                "copies_per_block_per_layer": len(g.pieces),
                                "page_order": g.page_order, "identical": same})
    store.close()
    return results


# -- 2. pinned vs pageable copies, against a plain tensor.copy_ --------------------------------

def median_s(torch, device, fn, repeat: int) -> float:
    times = []
    for _ in range(repeat + 1):  # the first run warms up
        sync(torch, device)
        t = time.perf_counter()
        fn()
        sync(torch, device)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def check_copies(torch, device, small: bool, repeat: int) -> dict:
    from spoolctl.connector.kv import layouts
    from spoolctl.connector.kv.kvio import BufferPool, PagedKV, view_declared

    layers, heads, head, num_blocks, per_chunk = (4, 2, 64, 64, 16) if small else \
        (32, 8, 128, 512, 16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    nbytes, decls = layouts.place(names, layout="LBNHC", num_blocks=num_blocks, heads=heads,
                                  states=16, content_bytes=2 * head * 2, itemsize=2,
                                  dtype="bfloat16")
    raw = torch.randint(-128, 127, (nbytes,), dtype=torch.int8, device=device)
    kv = PagedKV({n: view_declared(raw, d) for n, d in decls.items()},
                 num_blocks=num_blocks, blocks_per_chunk=per_chunk, declared=decls,
                 asynchronous=True)
    chunk = kv.chunk_bytes
    scattered = random.Random(1).sample(range(num_blocks), per_chunk)
    consecutive = list(range(5, 5 + per_chunk))
    dev_ref = torch.randint(0, 255, (chunk,), dtype=torch.uint8, device=device)
    doc: dict = {"layout": "LBNHC (flash-attn)", "chunk_bytes": chunk,
                 "layers": layers, "blocks_per_chunk": per_chunk, "repeat": repeat}
    cuda = device.type == "cuda"
    kinds = {"pageable": BufferPool(chunk, slots=1)}
    if cuda:
        kinds["pinned"] = BufferPool(chunk, slots=1, pin=True)
        doc["pinned_staging"] = kinds["pinned"].pinned
    else:
        doc["pinned"] = None
        doc["pinned_reason"] = "no CUDA device: host memory cannot be pinned"
    reference_pool = kinds.get("pinned", kinds["pageable"])
    host_ref = reference_pool.get()
    assert host_ref.numel() == dev_ref.numel() == chunk  # the reference does the same work
    ref_d2h = median_s(torch, device, lambda: host_ref.copy_(dev_ref), repeat)
    ref_h2d = median_s(torch, device, lambda: dev_ref.copy_(host_ref), repeat)
    reference_pool.put(host_ref)
    doc["reference"] = {"what": "tensor.copy_ of the same bytes, one contiguous range, "
                                + ("pinned host" if cuda else "host memory"),
                        "d2h_s": round(ref_d2h, 6), "h2d_s": round(ref_h2d, 6),
                        "d2h_GBps": round(chunk / ref_d2h / 1e9, 2),
                        "h2d_GBps": round(chunk / ref_h2d / 1e9, 2)}
    for kind, pool in kinds.items():
        buf = pool.get()
        row = {}
        for label, ids in (("consecutive", consecutive), ("scattered", scattered)):
            cap = median_s(torch, device,
                           lambda ids=ids, buf=buf: kv.capture(ids, buf).wait(), repeat)
            res = median_s(torch, device,
                           lambda ids=ids, buf=buf: kv.restore(buf, ids).wait(), repeat)
            issue = []
            for _ in range(repeat):
                sync(torch, device)
                t = time.perf_counter()
                h = kv.capture(ids, buf)
                issue.append(time.perf_counter() - t)
                h.wait()
            row[label] = {
                "capture_s": round(cap, 6), "restore_s": round(res, 6),
                "capture_GBps": round(chunk / cap / 1e9, 2),
                "restore_GBps": round(chunk / res / 1e9, 2),
                "capture_vs_reference": round(cap / ref_d2h, 2),
                "restore_vs_reference": round(res / ref_h2d, 2),
                "capture_issue_s": round(statistics.median(issue), 6),
                "capture_issue_vs_reference": round(statistics.median(issue) / ref_d2h, 2)}
        pool.put(buf)
        pool.close()
        doc[kind] = row
    return doc


# -- 3. the PyTorch controller: cold vs disk hit in a new process -------------------------------

def model_spec(small: bool):
    from spoolctl.demo.tinymodel import PRESETS, TinyModelSpec

    if small:
        return PRESETS["tiny"]
    # ~0.98B parameters: the shape of a 1B Llama (vocab from the local tokenizer).
    return TinyModelSpec(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=40960)


def build_params(backend, tokens: int):
    from spoolctl.controllers import CachePrepareParams

    rng = random.Random(tokens)
    data, elements = [], 8
    per = tokens // elements
    for _ in range(elements):
        text = " ".join(rng.choice(WORDS) for _ in range(per)) + "."
        n = len(backend.tokenize_segments([text + "\n"])[0])
        words = max(1, int(per * per / max(n, 1)))
        data.append(" ".join(rng.choice(WORDS) for _ in range(words)) + ".")
    return CachePrepareParams(instructions=["You answer from the data."],
                              data=data)


def controller_child(model: str, root: str, params_json: str, device: str,
                     dtype: str) -> None:
    import torch

    from spoolctl.controllers import CachePrepareParams
    from spoolctl.controllers.pytorch import PyTorchCacheController, quiet_frameworks

    quiet_frameworks()
    params = CachePrepareParams(**json.loads(params_json))
    with PyTorchCacheController(model, root, dtype=dtype, device=device) as ctl:
        ctl.backend.identity()  # hashed once per process, before timing
        dev = torch.device(device)
        sync(torch, dev)
        t = time.perf_counter()
        handle = ctl.prepare(params)
        sync(torch, dev)
        seconds = time.perf_counter() - t
        tokens = ctl.generate(handle, "Which valve?", 8).tokens
    print(json.dumps({"seconds": seconds, "source": handle.source, "tokens": list(tokens)}))


def check_controller(torch, device, small: bool, dtype: str, sizes: list[int],
                     work: Path) -> dict:
    from dataclasses import asdict

    from spoolctl.controllers.pytorch import PyTorchCacheController, quiet_frameworks
    from spoolctl.demo.tinymodel import build_tiny_model

    quiet_frameworks()
    spec = model_spec(small)
    t = time.perf_counter()
    model_dir = build_tiny_model(work / "model", spec)
    build_s = time.perf_counter() - t
    runs = []
    with PyTorchCacheController(model_dir, work / "warm", dtype=dtype,
                                device=str(device)) as ctl:
        backend = ctl.backend
        params_count = sum(p.numel() for p in backend.model.parameters())
        backend.generate(None, 0, list(range(1, 65)), 1)  # warm-up (kernels, allocator)
        for tokens in sizes:
            params = build_params(backend, tokens)
            root = work / f"store-{tokens}"
            with PyTorchCacheController(backend, root) as cold:
                sync(torch, device)
                t = time.perf_counter()
                handle = cold.prepare(params)
                sync(torch, device)
                cold_s = time.perf_counter() - t
                assert handle.source == "cold", handle
                entry_bytes = cold.store.row(handle.ref).size
                cold_tokens = list(cold.generate(handle, "Which valve?", 8).tokens)
            params_json = json.dumps({"model": params.model,
                                      "instructions": [e.content for e in params.instructions],
                                      "data": [e.content for e in params.data]})
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(model_dir), str(root), params_json,
                 str(device), dtype], capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                raise RuntimeError(f"disk-hit process failed: {out.stderr[-2000:]}")
            hit = json.loads(out.stdout.strip().splitlines()[-1])
            runs.append({"prompt_tokens": handle.cached_tokens, "entry_bytes": entry_bytes,
                         "cold_prepare_s": round(cold_s, 4),
                         "disk_hit_new_process_s": round(hit["seconds"], 4),
                         "disk_hit_source": hit["source"],
                         "speedup": round(cold_s / hit["seconds"], 1),
                         "same_tokens": hit["tokens"] == cold_tokens})
    return {"model": {**asdict(spec), "parameters": params_count, "dtype": dtype,
                      "build_s": round(build_s, 1)},
            "reference": "cold prepare (prefill + serialize + verified commit) in this run",
            "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--small", action="store_true", help="CI sizes (tiny model, short prompts)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tokens", default=None,
                    help="comma-separated prompt sizes (default 8192,32768; --small 256,512)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--skip-controller", action="store_true")
    ap.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        controller_child(*args.child)
        return 0
    import torch

    name = args.device or ("cuda" if torch.cuda.is_available() else None)
    if name is None:
        print(json.dumps({"check": "gpu", "ok": False, "error": "no CUDA device; pass "
                          "--device cpu to run the check on CPU"}))
        return 2
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"check": "gpu", "ok": False, "error": "CUDA is not available"}))
        return 2
    sizes = [int(s) for s in (args.tokens or ("256,512" if args.small else "8192,32768"))
             .split(",")]
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="spoolctl-gpu-"))
    work = Path(os.path.realpath(work))
    work.mkdir(parents=True, exist_ok=True)
    try:
        doc = {"check": "gpu", "device": device_info(torch, device), "small": args.small,
               "layouts": check_layouts(torch, device, args.small, work),
               "copy": check_copies(torch, device, args.small, args.repeat)}
        if not args.skip_controller:
            doc["controller"] = check_controller(torch, device, args.small, args.dtype, sizes,
                                                 work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    ok = all(r["identical"] for r in doc["layouts"])
    ok = ok and all(r["same_tokens"] and r["disk_hit_source"] == "disk"
                    for r in doc.get("controller", {}).get("runs", []))
    doc["ok"] = ok
    print(json.dumps(doc, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
