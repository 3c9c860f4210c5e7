#!/usr/bin/env python3
"""Cost of the cross-host inventory protocol next to the same-host catalog path.

With N chunks on a rank (default 100k), measured in one run:

* ``sync``: a worker's full inventory reaching a scheduler — the bounded handshake plus
  the per-step reports that follow — and the number of engine steps it takes;
* ``step_report``: one per-step report with 16 changes (what a worker adds to every
  engine step while serving), and one with nothing to say;
* ``lookup``: a 32-chunk chain looked up in the reported view (remote rank) vs
  ``Store.live`` on a real catalog holding the same N entries (the same-host path).

Prints JSON; medians of ``--repeat`` runs.

    python scripts/bench_inventory.py [--chunks 100000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

from spoolctl.connector.planning.inventory import (
    HANDSHAKE_MAX_KEYS,
    STEP_MAX_KEYS,
    InventoryView,
    RankInventory,
)
from spoolctl.store import Store, entry_id_for

NS = "bench-inventory-ns"


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_sync(n: int) -> dict:
    inv, view = RankInventory(0, 1), InventoryView()
    inv.replace(key(i) for i in range(n))
    t = time.perf_counter()
    view.apply(inv.report(HANDSHAKE_MAX_KEYS))
    handshake_s = time.perf_counter() - t
    steps = 0
    while (rep := inv.report(STEP_MAX_KEYS)) is not None and rep.size:
        view.apply(rep)
        steps += 1
    total_s = time.perf_counter() - t
    assert view.known(0) == n
    return {"handshake_s": handshake_s, "total_s": total_s, "steps_after_handshake": steps}


def bench_step(n: int, changes: int) -> float:
    inv, view = RankInventory(0, 1), InventoryView()
    inv.replace(key(i) for i in range(n))
    while (rep := inv.report(1 << 30)) is not None and rep.size:
        view.apply(rep)
    for i in range(n, n + changes):
        inv.add(key(i))
    return timed(lambda: inv.report(STEP_MAX_KEYS))


def bench_lookup(n: int, chain: int, root: Path) -> dict:
    view = InventoryView()
    inv = RankInventory(0, 1)
    inv.replace(key(i) for i in range(n))
    while (rep := inv.report(1 << 30)) is not None and rep.size:
        view.apply(rep)
    keys = [key(i) for i in range(n // 2, n // 2 + chain)]
    view_s = min(timed(lambda: view.has(0, keys)) for _ in range(50))
    with Store.open(root, create=True) as store:
        with store.catalog.write_transaction() as db:  # bulk rows: only the lookup is measured
            db.executemany(
                "INSERT INTO entries VALUES (?, 'vllm', ?, ?, 1, 1, 0, 0, 'retain', "
                "'committed', NULL, '{}')",
                ((entry_id_for("vllm", NS, key(i).hex()), NS, key(i).hex()) for i in range(n)))
        ids = [entry_id_for("vllm", NS, k.hex()) for k in keys]
        assert len(store.live(ids)) == chain
        catalog_s = min(timed(lambda: store.live(ids)) for _ in range(50))
    return {"reported_view_s": view_s, "catalog_s": catalog_s,
            "view_vs_catalog": round(view_s / catalog_s, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    n = args.chunks
    syncs = [bench_sync(n) for _ in range(args.repeat)]
    with tempfile.TemporaryDirectory() as tmp:
        lookup = bench_lookup(n, 32, Path(tmp) / "store")
    out = {
        "chunks": n,
        "limits": {"handshake_keys": HANDSHAKE_MAX_KEYS, "step_keys": STEP_MAX_KEYS},
        "sync": {
            "handshake_s": statistics.median(s["handshake_s"] for s in syncs),
            "total_s": statistics.median(s["total_s"] for s in syncs),
            "steps_after_handshake": syncs[0]["steps_after_handshake"],
        },
        "step_report_s": {
            "16_changes": statistics.median(bench_step(n, 16) for _ in range(args.repeat)),
            "no_change": statistics.median(bench_step(n, 0) for _ in range(args.repeat)),
        },
        "lookup_32_chunks": lookup,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
