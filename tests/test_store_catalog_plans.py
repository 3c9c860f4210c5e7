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

from spoolctl.store import Store, entry_id_for


def _plans(store: Store, call) -> list[str]:
    db = store.catalog._db
    statements: list[str] = []
    db.set_trace_callback(statements.append)
    try:
        call()
    finally:
        db.set_trace_callback(None)
    plans = []
    for sql in statements:
        if not re.match(r"\s*(SELECT|UPDATE)", sql, re.I):
            continue
        rows = db.execute(f"EXPLAIN QUERY PLAN {sql}").fetchall()
        plans.append(" | ".join(str(r[-1]) for r in rows))
    return plans


def test_live_and_touch_search_by_primary_key(store: Store) -> None:
    ids = []
    for i in range(40):
        store.put(kind="vllm", namespace="ns", key=f"k{i}", objects={"kv": b"x" * 10})
        ids.append(entry_id_for("vllm", "ns", f"k{i}"))
    # Age the entries so touch has rows to update (it skips recently touched ones).
    with store.catalog._write() as db:
        db.execute("UPDATE entries SET last_access = ?", (time.time() - 3600,))
    for call in (lambda: store.live(ids[:8]), lambda: store.touch(ids[:8])):
        plans = _plans(store, call)
        assert plans, "no statement was traced"
        for plan in plans:
            assert "PRIMARY KEY" in plan and "SCAN" not in plan, plan
            assert "entries_lru" not in plan, plan
