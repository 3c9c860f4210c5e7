"""What a well-formed catalog row is, in SQL and in Python (pure; no I/O).

The catalog is derived data that people can edit (``sqlite3``), clients can write facts
into (``Store.update_index``) and disks can damage. One malformed value must never stop
the cron job, a status or a metrics scrape, so every reader agrees on one definition:

* ``WELL_FORMED`` is an SQL expression over the ``entries`` table, true for a row whose
  columns have the types spoolctl writes and whose ``index_json`` is a JSON object with the
  facts the store interprets (``expire_time``: a number; ``remote_pending``: a boolean).
  Queries that select rows to list, delete or evict include it, so a ``LIMIT`` counts only
  rows that can be used, and a malformed row is skipped, never the whole query.
* ``parse_row`` turns an SQL row into a ``CatalogRow`` or raises ``MalformedRow`` with a
  short reason (the same rules, for rows read by id).
* ``INDEX_FACTS`` checks the facts a client writes, before they reach the catalog.

A skipped row is reported (``Store.malformed_rows``, ``status``, the
``spoolctl_store_malformed_rows`` gauge, a ``doctor`` finding) and repaired by
``spoolctl clean --orphans``, which re-indexes it from its manifest.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..format.keys import KINDS

_HEX64 = re.compile(r"[0-9a-f]{64}")

# The index facts the store itself interprets, and the JSON types they must have.
INDEX_FACTS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "expire_time": ("a number", lambda v: isinstance(v, (int, float))
                    and not isinstance(v, bool) and math.isfinite(v)),
    "remote_pending": ("true or false", lambda v: isinstance(v, bool)),
}

_KINDS_SQL = ", ".join(f"'{k}'" for k in sorted(KINDS))


def well_formed(row: str = "") -> str:
    """``WELL_FORMED`` over the columns of ``row`` (``"NEW."`` inside a trigger; ``""``:
    the ``entries`` table of the query). One text, so the trigger that records malformed
    rows (``schema``) and the queries cannot drift apart."""
    c = {name: row + name for name in (
        "entry_id", "kind", "namespace", "key", "size", "manifest_size", "created",
        "last_access", "supersedes", "index_json")}
    return (
        f"(typeof({c['entry_id']}) = 'text' AND length({c['entry_id']}) = 64 "
        f"AND NOT {c['entry_id']} GLOB '*[^0-9a-f]*' "
        f"AND {c['kind']} IN ({_KINDS_SQL}) "
        f"AND typeof({c['namespace']}) = 'text' AND typeof({c['key']}) = 'text' "
        f"AND typeof({c['size']}) = 'integer' AND {c['size']} >= 0 "
        f"AND typeof({c['manifest_size']}) = 'integer' AND {c['manifest_size']} >= 0 "
        f"AND typeof({c['created']}) IN ('integer', 'real') "
        f"AND typeof({c['last_access']}) IN ('integer', 'real') "
        f"AND ({c['supersedes']} IS NULL OR (typeof({c['supersedes']}) = 'text' "
        f"AND length({c['supersedes']}) = 64)) "
        # CASE short-circuits: json_type() on text that is not JSON would raise, not be false
        f"AND (CASE WHEN typeof({c['index_json']}) = 'text' AND json_valid({c['index_json']}) "
        f"THEN json_type({c['index_json']}) = 'object' "
        f"AND COALESCE(json_type({c['index_json']}, '$.expire_time') "
        "IN ('integer', 'real', 'null'), 1) "
        f"AND COALESCE(json_type({c['index_json']}, '$.remote_pending') "
        "IN ('true', 'false', 'null'), 1) "
        "ELSE 0 END))"
    )


# The columns ``WELL_FORMED`` reads: an UPDATE of any other (hint, state) cannot change it.
WELL_FORMED_COLUMNS = ("entry_id, kind, namespace, key, size, manifest_size, created, "
                       "last_access, supersedes, index_json")
WELL_FORMED = well_formed()
# Rows held for a remote delete (``remote_pending``): local cleanup and eviction skip them.
# A row whose index is not JSON counts as held (its facts are unknown: never delete it).
NOT_HELD = (
    "(CASE WHEN json_valid(index_json) THEN "
    "COALESCE(json_extract(index_json, '$.remote_pending'), 0) = 0 ELSE 0 END)"
)


class MalformedRow(ValueError):
    """A catalog row that is not what spoolctl writes; ``reason`` says which value."""

    def __init__(self, entry_id: str, reason: str):
        super().__init__(reason)
        self.entry_id = entry_id
        self.reason = reason


@dataclass(frozen=True)
class CatalogRow:
    """One entry as the catalog sees it."""

    entry_id: str
    kind: str
    namespace: str
    key: str
    size: int
    manifest_size: int
    created: float
    last_access: float
    hint: str
    state: str
    supersedes: str | None
    index: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "entry_id": self.entry_id, "kind": self.kind, "namespace": self.namespace,
            "size": self.size, "created": self.created, "last_access": self.last_access,
            "hint": self.hint, "state": self.state, "supersedes": self.supersedes,
        }


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_time(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def shown_id(value: Any) -> str:
    """An entry id column as text safe to report (whatever was stored there)."""
    text = value if isinstance(value, str) else repr(value)
    return text[:64]


def parse_row(row: tuple[Any, ...]) -> CatalogRow:
    """A ``CatalogRow`` from ``SELECT entry_id, kind, ..., index_json``; raises
    MalformedRow naming the first bad value."""
    (entry_id, kind, namespace, key, size, manifest_size, created, last_access, hint, state,
     supersedes, index_json) = row
    shown = shown_id(entry_id)

    def bad(why: str) -> MalformedRow:
        return MalformedRow(shown, why)

    if not isinstance(entry_id, str) or not _HEX64.fullmatch(entry_id):
        raise bad("entry_id is not 64 hex characters")
    if kind not in KINDS:
        raise bad("kind is not one of " + ", ".join(sorted(KINDS)))
    if not isinstance(namespace, str) or not isinstance(key, str):
        raise bad("namespace or key is not text")
    if not _is_int(size) or not _is_int(manifest_size):
        raise bad("size is not a non-negative integer")
    if not _is_time(created) or not _is_time(last_access):
        raise bad("created or last_access is not a number")
    if hint not in ("retain", "release") or state not in ("pending", "committed"):
        raise bad("hint or state is not a known value")
    if supersedes is not None and (not isinstance(supersedes, str)
                                   or not _HEX64.fullmatch(supersedes)):
        raise bad("supersedes is not an entry id")
    index = parse_index(index_json, shown)
    return CatalogRow(entry_id, kind, namespace, key, size, manifest_size, float(created),
                      float(last_access), hint, state, supersedes, index)


def parse_index(text: Any, entry_id: str = "") -> dict[str, Any]:
    """The index facts of a row (a JSON object); MalformedRow if not valid."""
    try:
        index = json.loads(text or "{}") if isinstance(text, (str, type(None))) else None
    except (ValueError, RecursionError):
        index = None
    if not isinstance(index, dict):
        raise MalformedRow(entry_id, "index is not a JSON object")
    problem = index_problem(index)
    if problem:
        raise MalformedRow(entry_id, problem)
    return index


def index_problem(index: Mapping[str, Any]) -> str | None:
    """Why ``index`` carries a fact of the wrong type (None if it does not)."""
    for name, (want, ok) in INDEX_FACTS.items():
        if name in index and index[name] is not None and not ok(index[name]):
            return f"index {name} is not {want} ({_short(index[name])})"
    return None


def valid_facts(index: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``index`` that are well formed (for repairing a row from its
    manifest without losing the catalog-only facts that are still good)."""
    return {k: v for k, v in index.items()
            if k not in INDEX_FACTS or v is None or INDEX_FACTS[k][1](v)}


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True, default=str)
    return text if len(text) <= 40 else text[:37] + "..."

# An encrypted entry's tenant id and key version, from its index's ``sealed`` fact.
SEALED_TENANT = "json_extract(index_json, '$.sealed.tenant')"
SEALED_VERSION = "json_extract(index_json, '$.sealed.version')"
