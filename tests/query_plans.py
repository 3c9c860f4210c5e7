"""SQLite's own query plans for the statements a store call executes (tests check plans, not
times: a plan that scans the catalog is a regression at a million entries)."""

from __future__ import annotations

import re
from collections.abc import Callable

from spoolctl.store import Store


def query_plans(store: Store, call: Callable[[], object],
                verbs: tuple[str, ...] = ("SELECT", "UPDATE")) -> list[str]:
    """Run ``call`` and return ``EXPLAIN QUERY PLAN`` of every statement starting with one of
    ``verbs`` that it executed on the store's catalog, one line per statement."""
    db = store.catalog.connection_for_inspection()
    statements: list[str] = []
    db.set_trace_callback(statements.append)
    try:
        call()
    finally:
        db.set_trace_callback(None)
    pattern = re.compile(r"\s*(" + "|".join(verbs) + ")", re.I)
    return [" | ".join(str(r[-1]) for r in db.execute(f"EXPLAIN QUERY PLAN {sql}").fetchall())
            for sql in statements if pattern.match(sql)]
