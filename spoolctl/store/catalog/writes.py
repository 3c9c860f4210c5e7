"""The catalog's changes: recording commits (pending, then committed), indexing found
manifests and bulk loads, hints (mirrored to the hint log), index updates, the LRU clock,
generation counters, releasing a tenant's encrypted entries and deleting entries. Each
change is one write transaction."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ..disk import faults
from ..format.clocks import FUTURE_SLACK
from ..format.manifest import Manifest
from . import load as catalog_load
from .database import HEX64, CatalogDb, chunks
from .hint_log import HintLog
from .rows import SEALED_TENANT, SEALED_VERSION
from .schema import COLUMNS, DDL, FILL_MALFORMED

# The LRU clock is only moved when it is this stale, so hot lookups do not write.
TOUCH_GRANULARITY = 30.0

Row = tuple[Any, ...]  # an ``entries`` row in ``COLUMNS`` order
Ref = tuple[str, str, int]  # (entry id, object digest, object size)


class CatalogWrites:
    """The changes to one catalog database; hint changes also go to ``hints``."""

    def __init__(self, db: CatalogDb, hints: HintLog):
        self._db = db
        self._hints = hints

    def record_intents(self, entries: Iterable[tuple[Manifest, int]], now: float, *,
                       claim: bool = False, hints: Mapping[str, str] | None = None
                       ) -> set[str]:
        """Record a batch of commits in flight (one transaction): a pending row per
        (manifest, manifest size) plus its object references; ``hints`` gives an entry a
        hint other than retain (an import keeping the source's).

        ``claim``: an entry that already has a row -- another writer's commit of the same
        entry in flight or done -- is left to it: not recorded, and its id returned. The
        check and the insert share one write transaction, so of two concurrent imports of
        one entry exactly one records it."""
        rows, refs = _rows_and_refs(entries, "pending", now, hints=hints)
        taken: set[str] = set()
        with self._db.write_transaction() as db:
            if claim and rows:
                ids = [row[0] for row in rows]
                for part in chunks(ids, 500):
                    taken.update(r[0] for r in db.execute(
                        f"SELECT entry_id FROM entries WHERE entry_id IN "
                        f"({','.join('?' * len(part))})", part))
                if taken:
                    rows = [row for row in rows if row[0] not in taken]
                    refs = [ref for ref in refs if ref[0] not in taken]
            self._insert_rows(db, rows, refs)
            self._hints.append((row[0], row[8]) for row in rows if row[8] != "retain")
        return taken

    def mark_committed(self, entry_id: str, supersedes: str | None) -> None:
        self.mark_committed_many([(entry_id, supersedes)])

    def mark_committed_many(self, entries: Iterable[tuple[str, str | None]]) -> None:
        """Mark rows committed, in order, in one transaction; release what each supersedes."""
        with self._db.write_transaction() as db:
            released = []
            for entry_id, supersedes in entries:
                db.execute("UPDATE entries SET state='committed' WHERE entry_id=?",
                           (entry_id,))
                if supersedes and db.execute("UPDATE entries SET hint='release' WHERE "
                                             "entry_id=?", (supersedes,)).rowcount:
                    released.append((supersedes, "release"))
            self._hints.append(released)

    def index_manifest(
        self, manifest: Manifest, manifest_size: int, *, hint: str = "retain",
        last_access: float | None = None, index: dict[str, Any] | None = None,
    ) -> None:
        """Index a manifest found on disk as committed (recovery and rebuild); ``index``
        replaces the manifest's index facts (a repair that keeps catalog-only facts)."""
        with self._db.write_transaction() as db:
            self._insert(db, manifest, manifest_size, last_access or manifest.created,
                         hint=hint, state="committed", index=index)

    def load(self, found: Iterable[Iterable[tuple[Manifest, int]]], *,
             hints: Mapping[str, str] | None = None) -> int:
        """Replace every entry with the manifests found on disk (last access = created),
        one batch of (manifest, manifest size) at a time, in one transaction
        (``catalog_load``: a rebuild). ``hints``: each entry's hint (the hint log's; retain
        when absent); the log is then rewritten with the released entries, in the same
        transaction. Returns the number of entries."""
        batches = (_rows_and_refs(batch, "committed", hints=hints) for batch in found)
        with self._db.lock, catalog_load.page_cache(self._db.connection), \
                self._db.write_transaction() as db:
            count = catalog_load.load(db, batches, ddl=DDL, columns=COLUMNS,
                                      fill_malformed=FILL_MALFORMED)
            self._rewrite_hints(db)
        self._db.has_kind_totals = True
        return count

    def seed_hints(self) -> None:
        """Write the hint log afresh from the catalog's released entries (a store of an
        older spoolctl, whose hints lived in its catalog alone), in one write transaction:
        no hint can change between the read and the rename."""
        with self._db.write_transaction() as db:
            self._rewrite_hints(db)
            faults.checkpoint("catalog.hints_seeded")  # crash tests: before the commit

    def _rewrite_hints(self, db: sqlite3.Connection) -> None:
        self._hints.rewrite(r[0] for r in db.execute(
            "SELECT entry_id FROM entries WHERE hint='release' ORDER BY entry_id"))

    @staticmethod
    def _insert_rows(db: sqlite3.Connection, rows: list[Row], refs: list[Ref]) -> None:
        """Insert (replace) ``entries`` rows and their object references, statement by
        statement over the batch (executemany)."""
        ids = [(row[0],) for row in rows]
        db.executemany("DELETE FROM entry_objects WHERE entry_id=?", ids)
        db.executemany("DELETE FROM entries WHERE entry_id=?", ids)
        db.executemany(f"INSERT INTO entries({COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                       rows)
        db.executemany("INSERT OR IGNORE INTO objects VALUES (?, ?)",
                       [(digest, size) for _, digest, size in refs])
        db.executemany("INSERT OR IGNORE INTO entry_objects VALUES (?, ?)",
                       [(entry_id, digest) for entry_id, digest, _ in refs])

    @staticmethod
    def _insert(db: sqlite3.Connection, manifest: Manifest, manifest_size: int, now: float,
                *, hint: str, state: str, index: dict[str, Any] | None = None) -> None:
        db.execute("DELETE FROM entry_objects WHERE entry_id=?", (manifest.entry_id,))
        db.execute("DELETE FROM entries WHERE entry_id=?", (manifest.entry_id,))
        db.execute(f"INSERT INTO entries({COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                   _row(manifest, manifest_size, now, hint, state, index))
        for ref in manifest.objects:
            db.execute("INSERT OR IGNORE INTO objects VALUES (?, ?)", (ref.digest, ref.size))
            db.execute("INSERT OR IGNORE INTO entry_objects VALUES (?, ?)",
                       (manifest.entry_id, ref.digest))

    def set_hint(self, entry_id: str, hint: str, now: float) -> bool:
        """Set the hint of a committed entry; ``now`` (the store's clock) is its access."""
        with self._db.write_transaction() as db:
            cur = db.execute(
                "UPDATE entries SET hint=?, last_access=? WHERE entry_id=? AND state='committed'",
                (hint, now, entry_id),
            )
            if cur.rowcount > 0:
                self._hints.append([(entry_id, hint)])
            return cur.rowcount > 0

    def update_index(self, entry_id: str, changes: dict[str, Any]) -> bool:
        """Merge ``changes`` into the row's index (a value of None removes that key).

        For facts that change after commit (a hosted cache's expire time, a pending
        remote delete). Like hints, these live only in the catalog: a rebuild restores
        the manifest's index. Returns False if there is no committed row.
        """
        with self._db.write_transaction() as db:
            row = db.execute("SELECT index_json FROM entries WHERE entry_id=? AND "
                             "state='committed'", (entry_id,)).fetchone()
            if row is None:
                return False
            try:
                index = json.loads(row[0] or "{}")
            except (TypeError, ValueError, RecursionError):
                index = None
            if not isinstance(index, dict):
                index = {}  # a malformed index is replaced by the new facts
            for k, v in changes.items():
                if v is None:
                    index.pop(k, None)
                else:
                    index[k] = v
            db.execute("UPDATE entries SET index_json=? WHERE entry_id=?",
                       (json.dumps(index, sort_keys=True), entry_id))
            return True

    def touch(self, entry_ids: Iterable[str], now: float) -> None:
        """Record an access at ``now`` (only where the last one is stale, so hot lookups do
        not write). A last access from the future (a clock that ran ahead) is stale too:
        the access now is the entry's real recency."""
        ahead = now + FUTURE_SLACK
        ids = [
            r[0] for chunk in chunks(list(entry_ids), 500) for r in self._db.read(
                f"SELECT entry_id FROM entries WHERE (+last_access < ? OR +last_access > ?) "
                f"AND entry_id IN ({','.join('?' * len(chunk))})",
                (now - TOUCH_GRANULARITY, ahead, *chunk))
        ]
        if not ids:
            return  # all recent: no write transaction at all
        with self._db.write_transaction() as db:
            for chunk in chunks(ids, 500):
                db.execute(
                    f"UPDATE entries SET last_access=? WHERE (+last_access < ? OR "
                    f"+last_access > ?) AND entry_id IN ({','.join('?' * len(chunk))})",
                    (now, now - TOUCH_GRANULARITY, ahead, *chunk),
                )

    def clamp_future_access(self, now: float) -> int:
        """Give every entry whose last access lies in the future (written while the clock
        ran ahead, not used since it was corrected) a last access just before the oldest
        trusted one of the store, so it is evicted first of the retained entries instead of
        last, after every entry used today. Returns how many rows changed."""
        ahead = now + FUTURE_SLACK
        probe = ("SELECT 1 FROM entries INDEXED BY entries_lru WHERE hint=? AND last_access > ? "
                 "AND typeof(last_access) IN ('integer', 'real') LIMIT 1")
        if not any(self._db.read(probe, (hint, ahead)) for hint in ("release", "retain")):
            return 0
        with self._db.write_transaction() as db:
            oldest = db.execute(
                "SELECT MIN(last_access) FROM entries WHERE last_access <= ? "
                "AND typeof(last_access) IN ('integer', 'real')", (ahead,)).fetchone()[0]
            cur = db.execute(
                "UPDATE entries SET last_access=? WHERE last_access > ? "
                "AND typeof(last_access) IN ('integer', 'real')",
                ((min(oldest, now) if oldest is not None else now) - 1.0, ahead))
            return cur.rowcount

    def next_generation(self, name: str) -> int:
        """Advance and return the persistent counter ``name``: larger than its last value
        and at least the current time in milliseconds, so it still grows after the
        catalog was rebuilt (unless the clock went back)."""
        with self._db.write_transaction() as db:
            row = db.execute("SELECT v FROM meta WHERE k=?", (f"gen:{name}",)).fetchone()
            last = int(row[0]) if row and str(row[0]).isdigit() else 0
            value = max(last + 1, int(time.time() * 1000))
            db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (f"gen:{name}", str(value)))
            return value

    def release_sealed(self, tenant_id: str, keep: int | None, now: float,
                       dry_run: bool = False) -> tuple[int, int]:
        """Release the committed entries of ``tenant_id`` (but those under key version
        ``keep``; None: all); returns (entries, bytes). ``dry_run`` only counts them.
        Versions are ids, not an order: "older than current" is "not
        current"."""
        where = (f"state='committed' AND hint='retain' AND json_valid(index_json) "
                 f"AND {SEALED_TENANT} = ? AND (? IS NULL OR {SEALED_VERSION} IS NOT ?)")
        params = (tenant_id, keep, keep)
        count = f"SELECT count(*), coalesce(sum(size), 0) FROM entries WHERE {where}"
        if dry_run:
            n, size = self._db.read(count, params)[0]
            return int(n), int(size)
        with self._db.write_transaction() as db:  # counted and released in one transaction
            n, size = db.execute(count, params).fetchone()
            ids = [r[0] for r in db.execute(f"SELECT entry_id FROM entries WHERE {where}",
                                            params)]
            db.execute(f"UPDATE entries SET hint='release', last_access=? WHERE {where}",
                       (now, *params))
            self._hints.append((entry_id, "release") for entry_id in ids)
        return int(n), int(size)

    def delete_entries(self, entry_ids: Iterable[Any]) -> list[tuple[str, int]]:
        """Drop entries; return the objects (digest, size) no remaining entry references.

        Set-based (a temp table of ids, then a few statements) so deleting thousands of
        entries costs a handful of index scans, not several statements per entry.
        """
        ids = [(entry_id,) for entry_id in entry_ids]
        if not ids:
            return []
        with self._db.write_transaction() as db:
            db.execute("CREATE TEMP TABLE IF NOT EXISTS doomed(entry_id TEXT PRIMARY KEY)")
            db.execute("CREATE TEMP TABLE IF NOT EXISTS touched(digest TEXT PRIMARY KEY)")
            db.execute("DELETE FROM temp.doomed")
            db.execute("DELETE FROM temp.touched")
            db.executemany("INSERT OR IGNORE INTO temp.doomed VALUES (?)", ids)
            db.execute("INSERT OR IGNORE INTO temp.touched SELECT digest FROM entry_objects "
                       "WHERE entry_id IN (SELECT entry_id FROM temp.doomed)")
            db.execute("DELETE FROM entry_objects WHERE entry_id IN "
                       "(SELECT entry_id FROM temp.doomed)")
            db.execute("DELETE FROM entries WHERE entry_id IN (SELECT entry_id FROM temp.doomed)")
            freed = db.execute(
                # CROSS JOIN fixes the loop order: the few touched digests outside, the
                # objects table searched by key (not scanned whole for every deletion).
                "SELECT o.digest, o.size FROM temp.touched t CROSS JOIN objects o "
                "ON o.digest = t.digest "
                "WHERE NOT EXISTS (SELECT 1 FROM entry_objects e WHERE e.digest = o.digest)"
            ).fetchall()
            db.executemany("DELETE FROM objects WHERE digest=?", [(d,) for d, _ in freed])
            # Deleted entries' lines stay in the hint log until it is written afresh.
            released = db.execute("SELECT COALESCE(SUM(entries), 0) FROM kind_totals "
                                  "WHERE hint='release'").fetchone()[0]
            if self._hints.oversized(int(released)):
                self._rewrite_hints(db)
        # Only well-formed digests name files: a hand-edited row must never become a path.
        return [(digest, size) for digest, size in freed
                if isinstance(digest, str) and HEX64.fullmatch(digest)
                and isinstance(size, int)]


def _row(manifest: Manifest, manifest_size: int, last_access: float, hint: str, state: str,
         index: dict[str, Any] | None = None) -> Row:
    """The ``entries`` row of ``manifest`` (``COLUMNS`` order)."""
    return (manifest.entry_id, manifest.kind, manifest.namespace, manifest.key,
            manifest.payload_bytes + manifest_size, manifest_size, manifest.created,
            last_access, hint, state, manifest.supersedes,
            json.dumps(dict(manifest.index if index is None else index), sort_keys=True))


def _rows_and_refs(entries: Iterable[tuple[Manifest, int]], state: str,
                   last_access: float | None = None, *,
                   hints: Mapping[str, str] | None = None
                   ) -> tuple[list[Row], list[Ref]]:
    """The ``entries`` rows of (manifest, manifest size) pairs (retained unless ``hints``
    says otherwise) and their object references (entry id, digest, size); last access
    ``last_access``, or each manifest's creation time if None."""
    rows: list[Row] = []
    refs: list[Ref] = []
    for manifest, size in entries:
        hint = hints.get(manifest.entry_id, "retain") if hints else "retain"
        rows.append(_row(manifest, size, manifest.created if last_access is None
                         else last_access, hint, state))
        refs += [(manifest.entry_id, r.digest, r.size) for r in manifest.objects]
    return rows, refs

