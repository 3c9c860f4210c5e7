"""The catalog's hot lookups use the primary key, not an index walk over every entry.

The vLLM scheduler asks ``Store.live`` about a prompt's chunk ids on every lookup, and
workers ``touch`` what they restore. With the ``(hint, last_access)`` index SQLite once
chose to walk every retained entry for those queries (100 ms at 100k entries, on vLLM's
engine loop). Query plans are checked, not times: SQLite's own ``EXPLAIN QUERY PLAN`` of
each statement these calls execute must search by primary key and never scan.
"""

from __future__ import annotations

import re
import time

import pytest
from query_plans import query_plans as _plans

from spoolctl.store import Store, entry_id_for

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)


def test_live_and_touch_search_by_primary_key(store: Store) -> None:
    ids = []
    for i in range(40):
        store.put(kind="vllm", namespace="ns", key=f"k{i}", objects={"kv": b"x" * 10})
        ids.append(entry_id_for("vllm", "ns", f"k{i}"))
    # Age the entries so touch has rows to update (it skips recently touched ones).
    with store.catalog.write_transaction() as db:
        db.execute("UPDATE entries SET last_access = ?", (time.time() - 3600,))
    for call in (lambda: store.live(ids[:8]), lambda: store.touch(ids[:8])):
        plans = _plans(store, call)
        assert plans, "no statement was traced"
        for plan in plans:
            assert "PRIMARY KEY" in plan and "SCAN" not in plan, plan
            assert "entries_lru" not in plan, plan


def test_deleting_entries_does_not_scan_the_objects_table(store: Store) -> None:
    """Freeing objects looks up the deleted entries' digests; it must not walk every object
    in the store for each batch (an O(store) cost per eviction or clean)."""
    for i in range(20):
        store.put(kind="vllm", namespace="ns", key=f"k{i}", objects={"kv": bytes([i]) * 10})
    doomed = [entry_id_for("vllm", "ns", f"k{i}") for i in range(5)]
    for entry_id in doomed:
        store.release(entry_id)
    plans = _plans(store, lambda: store.delete_released(doomed))
    assert plans
    for plan in plans:
        assert not re.search(r"SCAN (objects|o|entries|entry_objects)\b", plan), plan


def test_eviction_order_walks_the_lru_index(store: Store) -> None:
    """Choosing eviction victims reads the (hint, last_access) index up to the batch limit,
    released entries first; it does not sort the whole store for every batch."""
    for i in range(12):
        store.put(kind="vllm", namespace="ns", key=f"k{i}", objects={"kv": bytes([i]) * 10})
    released = entry_id_for("vllm", "ns", "k7")
    store.release(released)
    order: list = []
    plans = _plans(store, lambda: order.extend(store.catalog.eviction_order(3)))
    assert order[0] == (released, "release") and len(order) == 3
    assert all(hint == "retain" for _, hint in order[1:])
    for plan in plans:
        assert "entries_lru" in plan and "TEMP B-TREE" not in plan, plan
