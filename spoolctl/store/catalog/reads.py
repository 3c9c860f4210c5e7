"""The catalog's queries: rows, live entries, totals, eviction and cleaning orders, the
objects a deletion frees and the encrypted entries per tenant key. Read-only; every
query holds the connection's lock for its statement only."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .database import HEX64, CatalogDb, chunks
from .rows import (
    NOT_HELD,
    SEALED_TENANT,
    SEALED_VERSION,
    WELL_FORMED,
    CatalogRow,
    MalformedRow,
    parse_row,
)
from .schema import COLUMNS

SORTS = {"size": "size DESC", "age": "created ASC", "access": "last_access DESC",
         # id order groups a deletion batch into few manifest fan-out directories (fsyncs)
         "id": "entry_id ASC"}
_HINTS = {"retain": "retain", "release": "release"}


@dataclass(frozen=True)
class Totals:
    entries: int
    objects: int
    bytes: int


class CatalogReads:
    """The queries over one catalog database (thread-safe)."""

    def __init__(self, db: CatalogDb):
        self._db = db

    def get(self, entry_id: str) -> CatalogRow | None:
        """The row of ``entry_id``; None if there is none or it is malformed (remembered
        in ``malformed_seen``)."""
        rows = self._db.rows(self._db.read(f"SELECT {COLUMNS} FROM entries WHERE entry_id=?",
                                     (entry_id,)))
        return rows[0] if rows else None

    def live(self, entry_ids: Iterable[str]) -> set[str]:
        """The subset of ``entry_ids`` that are committed and retained (usable)."""
        found: set[str] = set()
        for chunk in chunks(list(entry_ids), 500):
            rows = self._db.read(
                # Unary "+" keeps SQLite from walking the (hint, last_access) index over
                # every retained entry: the primary key finds the few ids asked for.
                "SELECT entry_id FROM entries WHERE +hint='retain' AND +state='committed' "
                f"AND entry_id IN ({','.join('?' * len(chunk))})",
                chunk,
            )
            found.update(r[0] for r in rows)
        return found

    def manifest_sizes(self, entry_ids: Iterable[str]) -> dict[str, int]:
        """Each of ``entry_ids``' manifest size as recorded (absent or malformed rows
        left out): what deleting its manifest frees, without a stat of the file."""
        sizes: dict[str, int] = {}
        for chunk in chunks(list(entry_ids), 500):
            sizes.update(self._db.read(
                "SELECT entry_id, manifest_size FROM entries WHERE typeof(manifest_size)="
                f"'integer' AND manifest_size >= 0 AND entry_id IN ({','.join('?' * len(chunk))})",
                chunk))
        return sizes

    def freed_by(self, entry_ids: Iterable[str],
                 before: set[str] | None = None) -> list[tuple[str, int]]:
        """The objects (digest, size) that deleting ``entry_ids`` would free, read-only (the
        dry run's answer to what ``delete_entries`` returns): referenced by one of them and
        by no entry outside them and ``before`` (entries an earlier part of the same plan
        deletes; objects only those reference are not counted again). Costs the references
        of ``entry_ids`` and of the objects they name, not a pass over ``before``."""
        ids = sorted({str(e) for e in entry_ids})
        if not ids:
            return []
        mine, before = set(ids), before or set()
        digests = [r[0] for r in self._db.read(
            "SELECT DISTINCT digest FROM entry_objects WHERE entry_id IN "
            "(SELECT value FROM json_each(?))", (json.dumps(ids),))]
        kept: set[str] = set()
        for chunk in chunks(digests, 500):
            for digest, entry_id in self._db.read(
                    "SELECT digest, entry_id FROM entry_objects WHERE digest IN "
                    f"({','.join('?' * len(chunk))})", chunk):
                if entry_id not in mine and entry_id not in before:
                    kept.add(digest)
        freed = [d for d in digests if d not in kept]
        out: list[tuple[str, int]] = []
        for chunk in chunks(freed, 500):
            out += self._db.read(f"SELECT digest, size FROM objects WHERE digest IN "
                              f"({','.join('?' * len(chunk))})", chunk)
        # Only well-formed digests name files, as in ``delete_entries``.
        return [(digest, size) for digest, size in out
                if isinstance(digest, str) and HEX64.fullmatch(digest)
                and isinstance(size, int)]

    def live_keys(self, kind: str, namespace: str) -> set[str]:
        """The keys of every committed, retained entry of ``(kind, namespace)``."""
        return {r[0] for r in self._db.read(
            "SELECT key FROM entries WHERE kind=? AND namespace=? AND hint='retain' "
            "AND state='committed'", (kind, namespace))}

    def resolve_prefix(self, prefix: str, limit: int = 2) -> list[str]:
        hi = prefix + "g"  # 'g' sorts after every hex digit
        return [r[0] for r in self._db.read(
            "SELECT entry_id FROM entries WHERE entry_id >= ? AND entry_id < ? LIMIT ?",
            (prefix, hi, limit))]

    def list_rows(
        self, *, kind: str | None = None, namespace: str | None = None,
        hint: str | None = None, sort: str = "access", limit: int | None = None,
        include_pending: bool = False, skip_held: bool = False,
    ) -> list[CatalogRow]:
        """Well-formed rows matching the filters, in ``sort`` order, at most ``limit``.

        With ``sort="access"`` and a ``limit`` the newest rows are read from the
        ``(hint, last_access)`` index, one walk per hint merged, instead of sorting every
        row of the store (``released_page`` pages through released rows by id)."""
        where: list[str] = [WELL_FORMED]
        params: list[Any] = []
        if not include_pending:
            where.append("state='committed'")
        if skip_held:
            where.append(NOT_HELD)
        for column, value in (("kind", kind), ("namespace", namespace)):
            if value is not None:
                where.append(f"{column}=?")
                params.append(value)
        if sort == "access" and limit is not None:
            return self._newest(where, params, hint, limit)
        literal = None
        if hint is not None:
            literal = _HINTS.get(hint)  # the plain string, also for a str enum member
            if literal is None:
                raise ValueError(f"unknown hint {hint!r}")
            # A literal, not a parameter: only then may SQLite use the released rows'
            # partial index.
            where.append(f"hint='{literal}'")
        sql = f"SELECT {COLUMNS} FROM entries WHERE " + " AND ".join(where)
        sql += f" ORDER BY {SORTS[sort]}"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        return self._db.rows(self._db.read(sql, params))

    def released_page(self, after: str, limit: int) -> list[tuple[str, int]]:
        """``(entry_id, manifest_size)`` of up to ``limit`` released rows that ``clean``
        may delete (committed, well formed, not held for a remote delete) whose ids sort
        after ``after``, in id order: one page of a pass that reads each released row once.

        Only ids and sizes: building whole rows cost more than the query. The index is
        named, or SQLite would pick a filter column's index and sort every match for each
        page: released rows have their own (O(released) a pass); a catalog
        opened read-only from before it walks the primary key (each row read once)."""
        source = ("entries INDEXED BY entries_released" if self._db.released_index
                  else "entries INDEXED BY sqlite_autoindex_entries_1")
        return [(entry_id, size) for entry_id, size in self._db.read(
            f"SELECT entry_id, manifest_size FROM {source} WHERE hint='release' AND "
            f"state='committed' AND {WELL_FORMED} AND {NOT_HELD} AND entry_id > ? "
            "ORDER BY entry_id LIMIT ?", (after, limit))]

    def _newest(self, where: list[str], params: list[Any], hint: str | None,
                limit: int) -> list[CatalogRow]:
        rows: list[CatalogRow] = []
        for h in (hint,) if hint is not None else ("retain", "release"):
            rows += self._db.rows(self._db.read(
                f"SELECT {COLUMNS} FROM entries INDEXED BY entries_lru WHERE hint=? AND "
                + " AND ".join(where) + " ORDER BY last_access DESC LIMIT ?",
                [h, *params, limit]))
        rows.sort(key=lambda r: r.last_access, reverse=True)
        return rows[:limit]

    def malformed(self, limit: int = 100) -> list[tuple[Any, str]]:
        """(entry id exactly as stored, reason) of up to ``limit`` malformed rows (from
        ``malformed_rows``; a full scan of a version-1 catalog opened read-only). Show an
        id with ``rows.shown_id``: it may be anything."""
        if self._db.malformed_table:
            # CROSS JOIN: the few malformed rows outside, each row found by its key.
            columns = ", ".join(f"e.{c.strip()}" for c in COLUMNS.split(","))
            raw = self._db.read(f"SELECT {columns} FROM malformed_rows m CROSS JOIN entries e "
                             "ON e.entry_id = m.entry_id LIMIT ?", (limit,))
        else:
            raw = self._db.read(f"SELECT {COLUMNS} FROM entries WHERE NOT {WELL_FORMED} "
                             "LIMIT ?", (limit,))
        out = []
        for values in raw:
            try:
                parse_row(values)
                out.append((values[0], "a value of the wrong type"))
            except MalformedRow as exc:
                out.append((values[0], exc.reason))
        return out

    def raw_row(self, entry_id: Any) -> tuple[Any, Any] | None:
        """(hint, index_json) of a row exactly as stored (for repairs)."""
        rows = self._db.read("SELECT hint, index_json FROM entries WHERE entry_id=?", (entry_id,))
        return rows[0] if rows else None

    def malformed_count(self) -> int:
        """How many rows are malformed: O(malformed) from ``malformed_rows`` (a full scan of
        a version-1 catalog opened read-only)."""
        if self._db.malformed_table:
            return int(self._db.read("SELECT COUNT(*) FROM malformed_rows")[0][0])
        return int(self._db.read(f"SELECT COUNT(*) FROM entries WHERE NOT {WELL_FORMED}")[0][0])

    def iter_ids_after(self, after: str, batch: int) -> list[tuple[str, str]]:
        """(entry_id, state) in id order, for resumable walks such as the scrubber."""
        return [(r[0], r[1]) for r in self._db.read(
            "SELECT entry_id, state FROM entries WHERE entry_id > ? AND length(entry_id) = 64 "
            "AND NOT entry_id GLOB '*[^0-9a-f]*' ORDER BY entry_id LIMIT ?", (after, batch))]

    def pending(self) -> list[str]:
        """Ids of pending rows. SQLite answers from the partial index ``entries_pending``
        (no scan of the store); not named with INDEXED BY, so a read-only open of a catalog
        made before the index existed still works (by a scan)."""
        return [r[0] for r in self._db.read(
            "SELECT entry_id FROM entries WHERE state='pending' "
            "AND length(entry_id) = 64 AND NOT entry_id GLOB '*[^0-9a-f]*'")]

    def totals(self) -> Totals:
        return Totals(*self._db.read("SELECT entries, objects, bytes FROM totals WHERE id=0")[0])

    def by_kind(self) -> dict[str, dict[str, int]]:
        """Committed entries per kind: entries, bytes, released (O(kinds), ``kind_totals``)."""
        if self._db.has_kind_totals:
            rows = self._db.read("SELECT kind, hint, entries, bytes FROM kind_totals "
                              "WHERE state='committed' AND entries > 0")
        else:  # a read-only open of a catalog that was never opened writable since
            rows = self._db.read(
                "SELECT kind, hint, COUNT(*), SUM(size) FROM entries WHERE state='committed' "
                "GROUP BY kind, hint")
        out: dict[str, dict[str, int]] = {}
        for kind, hint, count, size in rows:
            slot = out.setdefault(kind, {"entries": 0, "bytes": 0, "released": 0})
            slot["entries"] += count
            slot["bytes"] += size or 0
            if hint == "release":
                slot["released"] += count
        return out

    def released_stats(self) -> tuple[int, int]:
        """(count, bytes) of released entries (O(kinds), ``kind_totals``)."""
        sql = ("SELECT COALESCE(SUM(entries), 0), COALESCE(SUM(bytes), 0) FROM kind_totals "
               "WHERE hint='release'") if self._db.has_kind_totals else \
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM entries WHERE hint='release'"
        count, size = self._db.read(sql)[0]
        return count, size

    def eviction_order(self, limit: int) -> list[tuple[str, str]]:
        """(entry_id, hint): released entries first, then least recently used."""
        # One query per hint, each walking the (hint, last_access) index and stopping at the
        # limit, instead of sorting every entry of the store for each eviction batch.
        out: list[tuple[str, str]] = []
        for hint in ("release", "retain"):
            if len(out) >= limit:
                break
            out += [(r[0], hint) for r in self._db.read(
                f"SELECT entry_id FROM entries INDEXED BY entries_lru WHERE hint=? "
                f"AND state='committed' AND {NOT_HELD} AND {WELL_FORMED} "
                "ORDER BY last_access ASC LIMIT ?",
                (hint, limit - len(out)))]
        return out

    def all_entry_ids(self) -> set[str]:
        return {r[0] for r in self._db.read("SELECT entry_id FROM entries")}

    def all_digests(self) -> set[str]:
        return {r[0] for r in self._db.read("SELECT digest FROM objects")}

    def sealed_counts(self) -> list[tuple[str, int, int, int]]:
        """``(tenant id, key version, entries, bytes)`` of the committed, retained encrypted
        entries (their index's ``sealed`` fact)."""
        return [(str(t), int(v), int(n), int(b)) for t, v, n, b in self._db.read(
            f"SELECT {SEALED_TENANT}, {SEALED_VERSION}, count(*), sum(size) FROM entries "
            f"WHERE state='committed' AND hint='retain' AND json_valid(index_json) "
            f"AND {SEALED_TENANT} IS NOT NULL GROUP BY 1, 2") if isinstance(v, int)]
