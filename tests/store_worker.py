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

from spoolctl.store import BusyError, Store


def payload(key: str, size: int) -> bytes:
    """Deterministic bytes for a key, so any reader can check what it got."""
    rnd = random.Random(key)
    return rnd.randbytes(size)


def main() -> None:
    root, command, *args = sys.argv[1:]
    store = Store.open(root, create=True)
    if command == "put":
        key, size = args[0], int(args[1])
        store.put(kind="pytorch", namespace="crash", key=key,
                  objects={"a": payload(key, size), "b": payload(key + "b", size // 2 + 1)})
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
