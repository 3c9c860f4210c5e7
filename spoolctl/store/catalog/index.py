"""The catalog: a derived SQLite index over manifests (``state/catalog.sqlite3``).

It holds what manifests cannot (they are immutable): the retain/release hint,
the LRU clock, and commit state. Everything else is a copy of manifest facts,
so the whole file can be rebuilt from ``manifests/``; every hint change is also appended
to ``state/hints.log`` (``hint_log``), which the rebuild reads too, so released entries
stay released (the LRU clock restarts at each entry's creation).

Rows move ``pending`` -> ``committed``: a commit records its intent (row and
object references) *before* its manifest is written, so a crash between
manifest and catalog leaves a pending row that recovery resolves by looking
for the manifest. Running totals are kept by triggers, so ``status`` is O(1).

One connection per Store, guarded by a lock (SQLite connections are not
thread-safe); WAL mode lets other processes read while one writes. A read-only catalog
(``read_only=True``) opens the file without creating or writing anything.

Rows are validated on the way out (``rows``): a malformed row is skipped and remembered
in ``malformed_seen``, never an exception that stops a whole listing or cleanup.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import RootError
from ..disk import faults
from ..disk.sqlite_files import DamagedDatabaseError, connect_private, connect_read_only
from ..disk.wal_checkpoints import BackgroundCheckpoints
from ..format.clocks import FUTURE_SLACK
from ..format.manifest import Manifest
from . import load as catalog_load
from .hint_log import NAME as HINT_LOG
from .hint_log import HintLog
from .rows import NOT_HELD, WELL_FORMED, CatalogRow, MalformedRow, parse_row
from .schema import COLUMNS as _COLUMNS
from .schema import DDL as _DDL
from .schema import DDL_V1, FILL_MALFORMED, MIGRATE_V1, SCHEMA_VERSION

SORTS = {"size": "size DESC", "age": "created ASC", "access": "last_access DESC",
         # id order groups a deletion batch into few manifest fan-out directories (fsyncs)
         "id": "entry_id ASC"}
# The LRU clock is only moved when it is this stale, so hot lookups do not write.
TOUCH_GRANULARITY = 30.0
# A row whose index carries ``"remote_pending": true`` records a remote resource (a
# hosted genai cache) that still exists and must be deleted on its server first:
# local cleanup and eviction skip it, so the record that lets a retry find it is kept
# (``rows.NOT_HELD``; a row whose index is not JSON counts as held).
MAX_MALFORMED_SEEN = 1000
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HINTS = {"retain": "retain", "release": "release"}

__all__ = ["NOT_HELD", "Catalog", "CatalogRow", "Totals"]


@dataclass(frozen=True)
class Totals:
    entries: int
    objects: int
    bytes: int


class Catalog:
    """Typed access to the catalog database. All methods are thread-safe."""

    def __init__(self, path: Path, *, read_only: bool = False, tmp: Path | None = None):
        self.path = path
        self.read_only = read_only
        # Where hint changes go besides the catalog (``tmp``: where a rewrite drafts it).
        self.hints = HintLog(path.with_name(HINT_LOG), tmp or path.parent)
        self._lock = threading.RLock()
        self._checkpoints: BackgroundCheckpoints | None = None
        # Malformed rows met while reading (entry id -> reason), for reports.
        self.malformed_seen: dict[str, str] = {}
        try:
            if read_only:
                self._db = connect_read_only(path, timeout=60, ddl=_DDL,
                                             earlier_ddl=(DDL_V1,))
            else:
                # NORMAL in WAL mode: a process crash loses nothing; a power cut may lose the
                # last transactions, which is safe because the catalog is derived (pending
                # rows and unindexed manifests are reconciled; see docs/decisions/0003).
                self._db = connect_private(path, ddl=_DDL, synchronous="NORMAL", timeout=60,
                                           earlier_ddl=(DDL_V1,))
        except DamagedDatabaseError:
            # A newer spoolctl's catalog is not damage: never quarantined and rebuilt.
            refuse_newer(stored_schema(path), path)
            raise
        try:
            if not read_only:
                self._db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)",
                                 (SCHEMA_VERSION,))
            row = self._db.execute("SELECT v FROM meta WHERE k='schema'").fetchone()
            version = row[0] if row else None
        except BaseException:
            self._db.close()
            raise
        refuse_newer(version, path, close=self._db)
        # A read-only open reads a version-1 catalog as it is (it cannot migrate it).
        if version != SCHEMA_VERSION and not (version == "1" and (read_only or self._migrate())):
            self._db.close()
            raise DamagedDatabaseError(f"catalog schema {version!r} is not {SCHEMA_VERSION!r}")
        # Malformed rows are in their own table (version 2); else found by a scan.
        self._malformed_table = version == SCHEMA_VERSION or not read_only
        try:
            if not read_only:
                self._fill_kind_totals()
            self._kind_totals = bool(self._db.execute(
                "SELECT 1 FROM meta WHERE k='kind_totals'").fetchone())
            # A catalog made before the index, opened read-only, does not have it.
            self._released_index = bool(self._db.execute(
                "SELECT 1 FROM sqlite_master WHERE type='index' AND name='entries_released'"
            ).fetchone())
        except BaseException:
            self._db.close()
            raise

    def _migrate(self) -> bool:
        """Migrate a version-1 catalog to this version in one write transaction (the
        connection applied the new DDL already); True when done. A crash midway leaves
        version 1, which the next writable open migrates again (decision 2920)."""
        try:
            with self._write() as db:
                row = db.execute("SELECT v FROM meta WHERE k='schema'").fetchone()
                if row is None or row[0] == SCHEMA_VERSION:
                    return row is not None  # another process migrated it meanwhile
                for statement in MIGRATE_V1:
                    db.execute(statement)
                faults.checkpoint("catalog.migrated")  # crash tests: before the commit
                db.execute("UPDATE meta SET v=? WHERE k='schema'", (SCHEMA_VERSION,))
        except BaseException:
            self._db.close()
            raise
        return True

    def _fill_kind_totals(self) -> None:
        """Fill ``kind_totals`` from the rows once, for a catalog made before it existed
        (its triggers keep it from then on, also for older writers of this file)."""
        if self._db.execute("SELECT 1 FROM meta WHERE k='kind_totals'").fetchone():
            return
        with self._write() as db:
            if db.execute("SELECT 1 FROM meta WHERE k='kind_totals'").fetchone():
                return  # another process filled it meanwhile
            db.execute("DELETE FROM kind_totals")
            db.execute("INSERT INTO kind_totals SELECT kind, hint, state, COUNT(*), "
                       "COALESCE(SUM(size), 0) FROM entries GROUP BY kind, hint, state")
            db.execute("INSERT INTO meta VALUES ('kind_totals', '1')")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def background_checkpoints(self) -> Iterator[None]:
        """While inside, this connection's commits do not checkpoint the WAL: a helper
        thread does after each write transaction, and the next one waits for it
        (``wal_checkpoints``, decision 1407). For a long run of large write transactions
        (``clean``), whose file work between them then overlaps the checkpoints."""
        with self._lock:
            nested = self._checkpoints is not None  # then the outer one stays in charge
            if not nested:
                previous = int(self._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0])
                self._db.execute("PRAGMA wal_autocheckpoint=0")
                self._checkpoints = BackgroundCheckpoints(self.path)
        if nested:
            yield
            return
        try:
            yield
        finally:
            with self._lock:
                checkpoints, self._checkpoints = self._checkpoints, None
                try:
                    checkpoints.close()
                finally:
                    self._db.execute(f"PRAGMA wal_autocheckpoint={previous}")

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._checkpoints is not None:
                self._checkpoints.wait()  # the log restarts at this write, not grows
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            else:
                self._db.execute("COMMIT")
            if self._checkpoints is not None:
                self._checkpoints.start()

    def _read(self, sql: str, params: Iterable = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, tuple(params)).fetchall()

    def _rows(self, raw: list[tuple]) -> list[CatalogRow]:
        """Parse rows; skip (and remember) malformed ones."""
        out = []
        for values in raw:
            try:
                out.append(parse_row(values))
            except MalformedRow as exc:
                self._seen(exc.entry_id, exc.reason)
        return out

    def _seen(self, entry_id: str, reason: str) -> None:
        if len(self.malformed_seen) < MAX_MALFORMED_SEEN:
            self.malformed_seen[entry_id] = reason

    # -- commit path ----------------------------------------------------------------------

    def record_intents(self, entries: Iterable[tuple[Manifest, int]], now: float, *,
                       claim: bool = False, hints: Mapping[str, str] | None = None
                       ) -> set[str]:
        """Record a batch of commits in flight (one transaction): a pending row per
        (manifest, manifest size) plus its object references; ``hints`` gives an entry a
        hint other than retain (an import keeping the source's, decision 2311).

        ``claim``: an entry that already has a row -- another writer's commit of the same
        entry in flight or done -- is left to it: not recorded, and its id returned. The
        check and the insert share one write transaction, so of two concurrent imports of
        one entry exactly one records it (issue 30.9)."""
        rows, refs = _rows_and_refs(entries, "pending", now, hints=hints)
        taken: set[str] = set()
        with self._write() as db:
            if claim and rows:
                ids = [row[0] for row in rows]
                for part in _chunks(ids, 500):
                    taken.update(r[0] for r in db.execute(
                        f"SELECT entry_id FROM entries WHERE entry_id IN "
                        f"({','.join('?' * len(part))})", part))
                if taken:
                    rows = [row for row in rows if row[0] not in taken]
                    refs = [ref for ref in refs if ref[0] not in taken]
            self._insert_rows(db, rows, refs)
            self.hints.append((row[0], row[8]) for row in rows if row[8] != "retain")
        return taken

    def mark_committed(self, entry_id: str, supersedes: str | None) -> None:
        self.mark_committed_many([(entry_id, supersedes)])

    def mark_committed_many(self, entries: Iterable[tuple[str, str | None]]) -> None:
        """Mark rows committed, in order, in one transaction; release what each supersedes."""
        with self._write() as db:
            released = []
            for entry_id, supersedes in entries:
                db.execute("UPDATE entries SET state='committed' WHERE entry_id=?",
                           (entry_id,))
                if supersedes and db.execute("UPDATE entries SET hint='release' WHERE "
                                             "entry_id=?", (supersedes,)).rowcount:
                    released.append((supersedes, "release"))
            self.hints.append(released)

    def index_manifest(
        self, manifest: Manifest, manifest_size: int, *, hint: str = "retain",
        last_access: float | None = None, index: dict | None = None,
    ) -> None:
        """Index a manifest found on disk as committed (recovery and rebuild); ``index``
        replaces the manifest's index facts (a repair that keeps catalog-only facts)."""
        with self._write() as db:
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
        with self._lock, catalog_load.page_cache(self._db), self._write() as db:
            count = catalog_load.load(db, batches, ddl=_DDL, columns=_COLUMNS,
                                      fill_malformed=FILL_MALFORMED)
            self._rewrite_hints(db)
        self._kind_totals = True
        return count

    def seed_hints(self) -> None:
        """Write the hint log afresh from the catalog's released entries (a store of an
        older spoolctl, whose hints lived in its catalog alone), in one write transaction:
        no hint can change between the read and the rename."""
        with self._write() as db:
            self._rewrite_hints(db)
            faults.checkpoint("catalog.hints_seeded")  # crash tests: before the commit

    def _rewrite_hints(self, db: sqlite3.Connection) -> None:
        self.hints.rewrite(r[0] for r in db.execute(
            "SELECT entry_id FROM entries WHERE hint='release' ORDER BY entry_id"))

    @staticmethod
    def _insert_rows(db, rows: list[tuple], refs: list[tuple[str, str, int]]) -> None:
        """Insert (replace) ``entries`` rows and their object references, statement by
        statement over the batch (executemany)."""
        ids = [(row[0],) for row in rows]
        db.executemany("DELETE FROM entry_objects WHERE entry_id=?", ids)
        db.executemany("DELETE FROM entries WHERE entry_id=?", ids)
        db.executemany(f"INSERT INTO entries({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                       rows)
        db.executemany("INSERT OR IGNORE INTO objects VALUES (?, ?)",
                       [(digest, size) for _, digest, size in refs])
        db.executemany("INSERT OR IGNORE INTO entry_objects VALUES (?, ?)",
                       [(entry_id, digest) for entry_id, digest, _ in refs])

    @staticmethod
    def _insert(db, manifest: Manifest, manifest_size: int, now: float, *, hint: str,
                state: str, index: dict | None = None) -> None:
        db.execute("DELETE FROM entry_objects WHERE entry_id=?", (manifest.entry_id,))
        db.execute("DELETE FROM entries WHERE entry_id=?", (manifest.entry_id,))
        db.execute(f"INSERT INTO entries({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                   _row(manifest, manifest_size, now, hint, state, index))
        for ref in manifest.objects:
            db.execute("INSERT OR IGNORE INTO objects VALUES (?, ?)", (ref.digest, ref.size))
            db.execute("INSERT OR IGNORE INTO entry_objects VALUES (?, ?)",
                       (manifest.entry_id, ref.digest))

    # -- hints and the LRU clock --------------------------------------------------------

    def set_hint(self, entry_id: str, hint: str, now: float) -> bool:
        """Set the hint of a committed entry; ``now`` (the store's clock) is its access."""
        with self._write() as db:
            cur = db.execute(
                "UPDATE entries SET hint=?, last_access=? WHERE entry_id=? AND state='committed'",
                (hint, now, entry_id),
            )
            if cur.rowcount > 0:
                self.hints.append([(entry_id, hint)])
            return cur.rowcount > 0

    def update_index(self, entry_id: str, changes: dict) -> bool:
        """Merge ``changes`` into the row's index (a value of None removes that key).

        For facts that change after commit (a hosted cache's expire time, a pending
        remote delete). Like hints, these live only in the catalog: a rebuild restores
        the manifest's index. Returns False if there is no committed row.
        """
        with self._write() as db:
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
        the access now is the entry's real recency (issue 30.7)."""
        ahead = now + FUTURE_SLACK
        ids = [
            r[0] for chunk in _chunks(list(entry_ids), 500) for r in self._read(
                f"SELECT entry_id FROM entries WHERE (+last_access < ? OR +last_access > ?) "
                f"AND entry_id IN ({','.join('?' * len(chunk))})",
                (now - TOUCH_GRANULARITY, ahead, *chunk))
        ]
        if not ids:
            return  # all recent: no write transaction at all
        with self._write() as db:
            for chunk in _chunks(ids, 500):
                db.execute(
                    f"UPDATE entries SET last_access=? WHERE (+last_access < ? OR "
                    f"+last_access > ?) AND entry_id IN ({','.join('?' * len(chunk))})",
                    (now, now - TOUCH_GRANULARITY, ahead, *chunk),
                )

    def clamp_future_access(self, now: float) -> int:
        """Give every entry whose last access lies in the future (written while the clock
        ran ahead, not used since it was corrected) a last access just before the oldest
        trusted one of the store, so it is evicted first of the retained entries instead of
        last, after every entry used today (issue 30.7, decision 2300). Returns how many
        rows changed; one indexed probe per hint when there are none."""
        ahead = now + FUTURE_SLACK
        probe = ("SELECT 1 FROM entries INDEXED BY entries_lru WHERE hint=? AND last_access > ? "
                 "AND typeof(last_access) IN ('integer', 'real') LIMIT 1")
        if not any(self._read(probe, (hint, ahead)) for hint in ("release", "retain")):
            return 0
        with self._write() as db:
            oldest = db.execute(
                "SELECT MIN(last_access) FROM entries WHERE last_access <= ? "
                "AND typeof(last_access) IN ('integer', 'real')", (ahead,)).fetchone()[0]
            cur = db.execute(
                "UPDATE entries SET last_access=? WHERE last_access > ? "
                "AND typeof(last_access) IN ('integer', 'real')",
                ((min(oldest, now) if oldest is not None else now) - 1.0, ahead))
            return cur.rowcount

    # -- queries ------------------------------------------------------------------------

    def get(self, entry_id: str) -> CatalogRow | None:
        """The row of ``entry_id``; None if there is none or it is malformed (remembered
        in ``malformed_seen``)."""
        rows = self._rows(self._read(f"SELECT {_COLUMNS} FROM entries WHERE entry_id=?",
                                     (entry_id,)))
        return rows[0] if rows else None

    def live(self, entry_ids: Iterable[str]) -> set[str]:
        """The subset of ``entry_ids`` that are committed and retained (usable)."""
        found: set[str] = set()
        for chunk in _chunks(list(entry_ids), 500):
            rows = self._read(
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
        for chunk in _chunks(list(entry_ids), 500):
            sizes.update(self._read(
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
        digests = [r[0] for r in self._read(
            "SELECT DISTINCT digest FROM entry_objects WHERE entry_id IN "
            "(SELECT value FROM json_each(?))", (json.dumps(ids),))]
        kept: set[str] = set()
        for chunk in _chunks(digests, 500):
            for digest, entry_id in self._read(
                    "SELECT digest, entry_id FROM entry_objects WHERE digest IN "
                    f"({','.join('?' * len(chunk))})", chunk):
                if entry_id not in mine and entry_id not in before:
                    kept.add(digest)
        freed = [d for d in digests if d not in kept]
        out: list[tuple[str, int]] = []
        for chunk in _chunks(freed, 500):
            out += self._read(f"SELECT digest, size FROM objects WHERE digest IN "
                              f"({','.join('?' * len(chunk))})", chunk)
        # Only well-formed digests name files, as in ``delete_entries``.
        return [(digest, size) for digest, size in out
                if isinstance(digest, str) and _HEX64.fullmatch(digest)
                and isinstance(size, int)]

    def live_keys(self, kind: str, namespace: str) -> set[str]:
        """The keys of every committed, retained entry of ``(kind, namespace)``."""
        return {r[0] for r in self._read(
            "SELECT key FROM entries WHERE kind=? AND namespace=? AND hint='retain' "
            "AND state='committed'", (kind, namespace))}

    def next_generation(self, name: str) -> int:
        """Advance and return the persistent counter ``name``: larger than its last value
        and at least the current time in milliseconds, so it still grows after the
        catalog was rebuilt (unless the clock went back)."""
        with self._write() as db:
            row = db.execute("SELECT v FROM meta WHERE k=?", (f"gen:{name}",)).fetchone()
            last = int(row[0]) if row and str(row[0]).isdigit() else 0
            value = max(last + 1, int(time.time() * 1000))
            db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (f"gen:{name}", str(value)))
            return value

    def resolve_prefix(self, prefix: str, limit: int = 2) -> list[str]:
        hi = prefix + "g"  # 'g' sorts after every hex digit
        return [r[0] for r in self._read(
            "SELECT entry_id FROM entries WHERE entry_id >= ? AND entry_id < ? LIMIT ?",
            (prefix, hi, limit))]

    def list(
        self, *, kind: str | None = None, namespace: str | None = None,
        hint: str | None = None, sort: str = "access", limit: int | None = None,
        include_pending: bool = False, skip_held: bool = False,
    ) -> list[CatalogRow]:
        """Well-formed rows matching the filters, in ``sort`` order, at most ``limit``.

        With ``sort="access"`` and a ``limit`` the newest rows are read from the
        ``(hint, last_access)`` index, one walk per hint merged, instead of sorting every
        row of the store (``released_page`` pages through released rows by id)."""
        where, params = [WELL_FORMED], []
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
        sql = f"SELECT {_COLUMNS} FROM entries WHERE " + " AND ".join(where)
        sql += f" ORDER BY {SORTS[sort]}"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        return self._rows(self._read(sql, params))

    def released_page(self, after: str, limit: int) -> list[tuple[str, int]]:
        """``(entry_id, manifest_size)`` of up to ``limit`` released rows that ``clean``
        may delete (committed, well formed, not held for a remote delete) whose ids sort
        after ``after``, in id order: one page of a pass that reads each released row once.

        Only ids and sizes: building whole rows cost more than the query. The index is
        named, or SQLite would pick a filter column's index and sort every match for each
        page: released rows have their own (O(released) a pass, decision 1406); a catalog
        opened read-only from before it walks the primary key (each row read once)."""
        source = ("entries INDEXED BY entries_released" if self._released_index
                  else "entries INDEXED BY sqlite_autoindex_entries_1")
        return [(entry_id, size) for entry_id, size in self._read(
            f"SELECT entry_id, manifest_size FROM {source} WHERE hint='release' AND "
            f"state='committed' AND {WELL_FORMED} AND {NOT_HELD} AND entry_id > ? "
            "ORDER BY entry_id LIMIT ?", (after, limit))]

    def _newest(self, where: list[str], params: list, hint: str | None,
                limit: int) -> list[CatalogRow]:
        rows: list[CatalogRow] = []
        for h in (hint,) if hint is not None else ("retain", "release"):
            rows += self._rows(self._read(
                f"SELECT {_COLUMNS} FROM entries INDEXED BY entries_lru WHERE hint=? AND "
                + " AND ".join(where) + " ORDER BY last_access DESC LIMIT ?",
                [h, *params, limit]))
        rows.sort(key=lambda r: r.last_access, reverse=True)
        return rows[:limit]

    def malformed(self, limit: int = 100) -> list[tuple[Any, str]]:
        """(entry id exactly as stored, reason) of up to ``limit`` malformed rows (from
        ``malformed_rows``; a full scan of a version-1 catalog opened read-only). Show an
        id with ``rows.shown_id``: it may be anything."""
        if self._malformed_table:
            # CROSS JOIN: the few malformed rows outside, each row found by its key.
            columns = ", ".join(f"e.{c.strip()}" for c in _COLUMNS.split(","))
            raw = self._read(f"SELECT {columns} FROM malformed_rows m CROSS JOIN entries e "
                             "ON e.entry_id = m.entry_id LIMIT ?", (limit,))
        else:
            raw = self._read(f"SELECT {_COLUMNS} FROM entries WHERE NOT {WELL_FORMED} "
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
        rows = self._read("SELECT hint, index_json FROM entries WHERE entry_id=?", (entry_id,))
        return rows[0] if rows else None

    def malformed_count(self) -> int:
        """How many rows are malformed: O(malformed) from ``malformed_rows`` (a full scan of
        a version-1 catalog opened read-only)."""
        if self._malformed_table:
            return int(self._read("SELECT COUNT(*) FROM malformed_rows")[0][0])
        return int(self._read(f"SELECT COUNT(*) FROM entries WHERE NOT {WELL_FORMED}")[0][0])

    def iter_ids_after(self, after: str, batch: int) -> list[tuple[str, str]]:
        """(entry_id, state) in id order, for resumable walks such as the scrubber."""
        return [(r[0], r[1]) for r in self._read(
            "SELECT entry_id, state FROM entries WHERE entry_id > ? AND length(entry_id) = 64 "
            "AND NOT entry_id GLOB '*[^0-9a-f]*' ORDER BY entry_id LIMIT ?", (after, batch))]

    def pending(self) -> list[str]:
        """Ids of pending rows. SQLite answers from the partial index ``entries_pending``
        (no scan of the store); not named with INDEXED BY, so a read-only open of a catalog
        made before the index existed still works (by a scan)."""
        return [r[0] for r in self._read(
            "SELECT entry_id FROM entries WHERE state='pending' "
            "AND length(entry_id) = 64 AND NOT entry_id GLOB '*[^0-9a-f]*'")]

    def totals(self) -> Totals:
        return Totals(*self._read("SELECT entries, objects, bytes FROM totals WHERE id=0")[0])

    def by_kind(self) -> dict[str, dict[str, int]]:
        """Committed entries per kind: entries, bytes, released (O(kinds), ``kind_totals``)."""
        if self._kind_totals:
            rows = self._read("SELECT kind, hint, entries, bytes FROM kind_totals "
                              "WHERE state='committed' AND entries > 0")
        else:  # a read-only open of a catalog that was never opened writable since
            rows = self._read(
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
               "WHERE hint='release'") if self._kind_totals else \
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM entries WHERE hint='release'"
        count, size = self._read(sql)[0]
        return count, size

    def eviction_order(self, limit: int) -> list[tuple[str, str]]:
        """(entry_id, hint): released entries first, then least recently used."""
        # One query per hint, each walking the (hint, last_access) index and stopping at the
        # limit, instead of sorting every entry of the store for each eviction batch.
        out: list[tuple[str, str]] = []
        for hint in ("release", "retain"):
            if len(out) >= limit:
                break
            out += [(r[0], hint) for r in self._read(
                f"SELECT entry_id FROM entries INDEXED BY entries_lru WHERE hint=? "
                f"AND state='committed' AND {NOT_HELD} AND {WELL_FORMED} "
                "ORDER BY last_access ASC LIMIT ?",
                (hint, limit - len(out)))]
        return out

    def all_entry_ids(self) -> set[str]:
        return {r[0] for r in self._read("SELECT entry_id FROM entries")}

    def all_digests(self) -> set[str]:
        return {r[0] for r in self._read("SELECT digest FROM objects")}

    # -- encrypted entries (decision 2800) --------------------------------------------

    def sealed_counts(self) -> list[tuple[str, int, int, int]]:
        """``(tenant id, key version, entries, bytes)`` of the committed, retained encrypted
        entries (their index's ``sealed`` fact)."""
        return [(str(t), int(v), int(n), int(b)) for t, v, n, b in self._read(
            f"SELECT {_TENANT}, {_VERSION}, count(*), sum(size) FROM entries "
            f"WHERE state='committed' AND hint='retain' AND json_valid(index_json) "
            f"AND {_TENANT} IS NOT NULL GROUP BY 1, 2") if isinstance(v, int)]

    def release_sealed(self, tenant_id: str, keep: int | None, now: float,
                       dry_run: bool = False) -> tuple[int, int]:
        """Release the committed entries of ``tenant_id`` (but those under key version
        ``keep``; None: all); returns (entries, bytes). ``dry_run`` only counts them.
        Versions are ids, not an order (decision 2812): "older than current" is "not
        current"."""
        where = (f"state='committed' AND hint='retain' AND json_valid(index_json) "
                 f"AND {_TENANT} = ? AND (? IS NULL OR {_VERSION} IS NOT ?)")
        params = (tenant_id, keep, keep)
        count = f"SELECT count(*), coalesce(sum(size), 0) FROM entries WHERE {where}"
        if dry_run:
            n, size = self._read(count, params)[0]
            return int(n), int(size)
        with self._write() as db:  # counted and released in one transaction
            n, size = db.execute(count, params).fetchone()
            ids = [r[0] for r in db.execute(f"SELECT entry_id FROM entries WHERE {where}",
                                            params)]
            db.execute(f"UPDATE entries SET hint='release', last_access=? WHERE {where}",
                       (now, *params))
            self.hints.append((entry_id, "release") for entry_id in ids)
        return int(n), int(size)

    # -- deletion ---------------------------------------------------------------------

    def delete_entries(self, entry_ids: Iterable[Any]) -> list[tuple[str, int]]:
        """Drop entries; return the objects (digest, size) no remaining entry references.

        Set-based (a temp table of ids, then a few statements) so deleting thousands of
        entries costs a handful of index scans, not several statements per entry.
        """
        ids = [(entry_id,) for entry_id in entry_ids]
        if not ids:
            return []
        with self._write() as db:
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
            if self.hints.oversized(int(released)):
                self._rewrite_hints(db)
        # Only well-formed digests name files: a hand-edited row must never become a path.
        return [(digest, size) for digest, size in freed
                if isinstance(digest, str) and _HEX64.fullmatch(digest)
                and isinstance(size, int)]

    def quick_check(self) -> str:
        return str(self._read("PRAGMA quick_check")[0][0])


def _row(manifest: Manifest, manifest_size: int, last_access: float, hint: str, state: str,
         index: dict | None = None) -> tuple:
    """The ``entries`` row of ``manifest`` (``_COLUMNS`` order)."""
    return (manifest.entry_id, manifest.kind, manifest.namespace, manifest.key,
            manifest.payload_bytes + manifest_size, manifest_size, manifest.created,
            last_access, hint, state, manifest.supersedes,
            json.dumps(dict(manifest.index if index is None else index), sort_keys=True))


def _rows_and_refs(entries: Iterable[tuple[Manifest, int]], state: str,
                   last_access: float | None = None, *,
                   hints: Mapping[str, str] | None = None
                   ) -> tuple[list[tuple], list[tuple[str, str, int]]]:
    """The ``entries`` rows of (manifest, manifest size) pairs (retained unless ``hints``
    says otherwise) and their object references (entry id, digest, size); last access
    ``last_access``, or each manifest's creation time if None."""
    rows, refs = [], []
    for manifest, size in entries:
        hint = hints.get(manifest.entry_id, "retain") if hints else "retain"
        rows.append(_row(manifest, size, manifest.created if last_access is None
                         else last_access, hint, state))
        refs += [(manifest.entry_id, r.digest, r.size) for r in manifest.objects]
    return rows, refs


_TENANT = "json_extract(index_json, '$.sealed.tenant')"
_VERSION = "json_extract(index_json, '$.sealed.version')"


def _chunks(items: list[str], n: int) -> Iterator[list[str]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


def stored_schema(path: Path) -> str | None:
    """The schema version a catalog file says it has, read without running anything of
    the file's (its ``meta`` table must be exactly ours); None when it cannot be told."""
    try:
        db = connect_read_only(path, timeout=5, snapshot=True)  # creates no -wal, -shm
    except sqlite3.Error:
        return None
    try:
        meta = db.execute("SELECT sql FROM sqlite_master WHERE name='meta'").fetchone()
        if meta is None or meta[0] != _META_SQL:
            return None
        row = db.execute("SELECT v FROM meta WHERE k='schema'").fetchone()
        return str(row[0]) if row else None
    except sqlite3.Error:
        return None
    finally:
        db.close()


def refuse_newer(version: str | None, path: Path,
                 close: sqlite3.Connection | None = None) -> None:
    """RootError (nothing changed) when ``version`` is a catalog schema newer than this
    spoolctl's: a newer spoolctl wrote it, and rebuilding it would lose what it holds."""
    if version is None or not version.isdigit() or int(version) <= int(SCHEMA_VERSION):
        return
    if close is not None:
        close.close()
    raise RootError(f"the catalog has schema {version}, newer than this spoolctl reads (up "
                    f"to {SCHEMA_VERSION}): a newer version wrote it; nothing was changed",
                    path=path, fix="run the spoolctl version that wrote the store (or newer)")


_META_SQL = "CREATE TABLE meta(k TEXT PRIMARY KEY, v TEXT NOT NULL)"
