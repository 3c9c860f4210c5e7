#!/usr/bin/env python3
"""What the disk deadlines cost and what they bound (issue 32, decision 2700); prints JSON.

* ``lookup``: a catalog lookup of 32 ids on a store of ``--entries`` entries, read directly
  vs through the store's ``DiskGuard`` (one thread per call): p50/p99/max in microseconds.
* ``hung_restore``: a restore of ``--chunks`` chunks whose reads hang (held in the read as a
  hung disk holds them) returns at its deadline: the measured time to the miss vs the
  deadline, and whether the store was taken out after three such restores.

Small by default (seconds); full size: ``python scripts/bench_disk_deadlines.py --entries
100000 --repeat 2000``. The end-to-end TTFT with a hung FUSE disk under a real vLLM engine
is not measured here yet.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor


def _pct(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50_us": round(s[len(s) // 2] * 1e6, 1),
            "p99_us": round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6, 1),
            "max_us": round(s[-1] * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=300)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--deadline", type=float, default=0.2)
    args = ap.parse_args()

    from spoolctl.connector.diskguard import DiskGuard
    from spoolctl.connector.stats import ConnectorCounters
    from spoolctl.connector.worker_side.restore import ChunkRestore, RestorePipeline
    from spoolctl.store import Store, entry_id_for

    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp, \
            Store.open(os.path.join(os.path.realpath(tmp), "r"), create=True) as store:
        for i in range(args.entries):
            store.put(kind="vllm", namespace="ns", key=f"{i:064x}",
                      objects={"kv": i.to_bytes(8, "big") * 8})
        ids = [entry_id_for("vllm", "ns", f"{i:064x}") for i in range(32)]
        guard = DiskGuard(store)
        for name, fn in (("direct", lambda: store.live(ids)),
                         ("guarded", lambda: guard.call(lambda: store.live(ids)))):
            times = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            out.setdefault("lookup", {})[name] = _pct(times)

        gate = threading.Event()

        def fill(store, manifest, buf) -> int:
            gate.wait()
            return 0

        items = [ChunkRestore(f"{i:064x}", lambda m: True, fill, lambda buf: None)
                 for i in range(args.chunks)]
        counters = ConnectorCounters()
        hung = DiskGuard(store, probe_interval_s=3600)
        waited = []
        with ThreadPoolExecutor(4) as pool:
            pipe = RestorePipeline(store, "ns", chunk_bytes=64, pool=pool, counters=counters,
                                   on_lost=lambda key: None, deadline_s=args.deadline,
                                   guard=hung)
            for n in range(3):
                t = time.perf_counter()
                pipe.begin(f"r{n}", items)
                ended = pipe.pump(wait_s=60)
                waited.append(time.perf_counter() - t)
                assert ended == [(f"r{n}", 0)], ended
            t = time.perf_counter()
            pipe.begin("after", items)
            after = pipe.pump(wait_s=0)
            out["hung_restore"] = {
                "deadline_s": args.deadline, "miss_after_s": [round(w, 3) for w in waited],
                "store_taken_out": hung.down, "restore_while_out": after,
                "restore_while_out_s": round(time.perf_counter() - t, 6)}
            gate.set()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
