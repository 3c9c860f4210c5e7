"""A subprocess that drives the store for crash and concurrency tests.

Usage: python store_worker.py ROOT COMMAND [ARGS...]; it exits 0 when done, or
with faults.CRASH_EXIT_CODE when SPOOLCTL_CRASH_AT killed it at a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time

from spoolctl.store import BusyError, PutRequest, Store


def payload(key: str, size: int) -> bytes:
    """Deterministic bytes for a key, so any reader can check what it got."""
    rnd = random.Random(key)
    return rnd.randbytes(size)


def batch_objects(prefix: str, i: int, size: int) -> dict[str, bytes]:
    """Objects of entry ``i`` of a batch: entry 2 shares object ``b`` with entry 1, so a
    batch also publishes an object two of its entries name."""
    shared = f"{prefix}-1b" if i == 2 else f"{prefix}-{i}b"
    return {"a": payload(f"{prefix}-{i}", size), "b": payload(shared, size // 2 + 1)}


def bad_stream(prefix: str):
    """A streamed payload that fails half-way (a chunk that is not bytes)."""
    yield payload(prefix + "-bad", 5000)
    yield "not bytes"


def main() -> None:
    root, command, *args = sys.argv[1:]
    store = Store.open(root, create=True)
    if command == "put":
        key, size = args[0], int(args[1])
        store.put(kind="pytorch", namespace="crash", key=key,
                  objects={"a": payload(key, size), "b": payload(key + "b", size // 2 + 1)})
    elif command == "put-batch":
        # One group commit of N entries (plus one that fails while it streams, which must
        # never become visible); prints the outcomes.
        prefix, n, size = args[0], int(args[1]), int(args[2])
        requests = [PutRequest("pytorch", "crash", f"{prefix}-{i}",
                               batch_objects(prefix, i, size)) for i in range(n)]
        requests.insert(n // 2, PutRequest("pytorch", "crash", f"{prefix}-bad",
                                           {"a": bad_stream(prefix)}))
        outcomes = store.put_many(requests)
        print(json.dumps([o.status for o in outcomes]))
    elif command == "release-clean":
        entry_id = store.entry_id("pytorch", "crash", args[0])
        store.release(entry_id)
        store.clean_released()
    elif command == "evict":
        store.set_max_bytes(int(args[0]))
        store.enforce_capacity()
    elif command == "read":
        m = store.lookup("pytorch", "crash", args[0])
        if m is not None:
            store.read(m, "a")
    elif command == "churn":
        # Concurrency soak: commit own and shared keys, release a deterministic subset of own
        # keys, and verify every hit. Writes its expected hints to a JSON file.
        name, seconds, out = args[0], float(args[1]), args[2]
        deadline = time.monotonic() + seconds
        expected: dict[str, str] = {}
        i = 0
        while time.monotonic() < deadline:
            key = f"{name}-{i}"
            store.put(kind="pytorch", namespace="churn", key=key, objects={"a": payload(key, 2048)})
            shared = f"shared-{i % 7}"
            store.put(kind="pytorch", namespace="churn", key=shared,
                      objects={"a": payload(shared, 2048)})
            m = store.lookup("pytorch", "churn", shared)
            if m is not None:
                assert bytes(store.read(m, "a")) == payload(shared, 2048)
            expected[key] = "retain"
            if i % 3 == 0:
                assert store.release(store.entry_id("pytorch", "churn", key))
                expected[key] = "release"
            i += 1
        with open(out, "w") as f:
            json.dump(expected, f)
    elif command == "cleaner":
        seconds = float(args[0])
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with contextlib.suppress(BusyError):
                store.clean_released()
            time.sleep(0.05)
    else:
        raise SystemExit(f"unknown command {command}")
    store.close()
    os._exit(0)


if __name__ == "__main__":
    main()
