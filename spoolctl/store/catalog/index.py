"""The catalog: a derived SQLite index over manifests (``state/catalog.sqlite3``).

It holds what manifests cannot (they are immutable): the retain/release hint, the LRU
clock and commit state; the rest copies manifest facts, so the file can be rebuilt from
``manifests/`` and ``state/hints.log`` (every hint change is appended there too). Rows move
``pending`` -> ``committed``: a commit records its intent before its manifest is written.
Running totals are kept by triggers. One connection per store, guarded by a lock; WAL mode
lets other processes read while one writes. Malformed rows are skipped and remembered in
``malformed_seen``, never an exception.

``Catalog`` is a facade over three parts: ``database.CatalogDb`` (the connection and its
transactions), ``reads.CatalogReads`` (the queries) and ``writes.CatalogWrites`` (the
changes).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from ..delegation import delegate
from ..disk.wal_checkpoints import BackgroundCheckpoints
from .database import CatalogDb, refuse_newer, stored_schema
from .hint_log import NAME as HINT_LOG
from .hint_log import HintLog
from .reads import SORTS, CatalogReads, Totals
from .rows import NOT_HELD, CatalogRow
from .writes import TOUCH_GRANULARITY, CatalogWrites

__all__ = ["NOT_HELD", "SORTS", "TOUCH_GRANULARITY", "Catalog", "CatalogRow", "Totals",
           "refuse_newer", "stored_schema"]


class Catalog:
    """Typed access to the catalog database at ``path``; all methods are thread-safe.
    ``tmp``: where a rewrite of the hint log is drafted (default: beside the catalog).
    Raises DamagedDatabaseError for a damaged or unknown file, RootError for a newer
    schema."""

    def __init__(self, path: Path, *, read_only: bool = False, tmp: Path | None = None):
        self.path = path
        self.read_only = read_only
        self.hints = HintLog(path.with_name(HINT_LOG), tmp or path.parent)
        self._db = CatalogDb(path, read_only=read_only)
        self._reads = CatalogReads(self._db)
        self._writes = CatalogWrites(self._db, self.hints)

    @property
    def malformed_seen(self) -> dict[str, str]:
        """Malformed rows met while reading (entry id -> reason), at most a thousand."""
        return self._db.malformed_seen

    def close(self) -> None:
        self._db.close()

    def background_checkpoints(self) -> AbstractContextManager[None]:
        """While inside, a helper thread checkpoints the WAL after each write transaction
        (for a long run of large ones, such as ``clean``)."""
        return self._db.background_checkpoints()

    def quick_check(self) -> str:
        """SQLite's ``PRAGMA quick_check`` answer (``ok`` when sound)."""
        return self._db.quick_check()

    # -- inspection (tests and diagnostics) ------------------------------------------------

    @property
    def has_kind_totals(self) -> bool:
        """Whether the ``kind_totals`` table is filled (per-kind totals in O(kinds))."""
        return self._db.has_kind_totals

    @property
    def background_checkpointer(self) -> BackgroundCheckpoints | None:
        """The helper thread of ``background_checkpoints`` while one is active."""
        return self._db.checkpointer

    def connection_for_inspection(self) -> sqlite3.Connection:
        """The catalog's own connection, to read what it holds or how SQLite plans a query;
        writes go through ``write_transaction``."""
        return self._db.connection

    def write_transaction(self) -> AbstractContextManager[sqlite3.Connection]:
        """One write transaction on the catalog's connection (committed on success, rolled
        back on an exception), for repairs that shape rows directly."""
        return self._db.write_transaction()

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold the connection's lock: every other catalog call of this process waits."""
        with self._db.lock:
            yield

    # -- changes (``writes``) -----------------------------------------------------------

    record_intents = delegate(CatalogWrites.record_intents, "_writes")
    mark_committed = delegate(CatalogWrites.mark_committed, "_writes")
    mark_committed_many = delegate(CatalogWrites.mark_committed_many, "_writes")
    index_manifest = delegate(CatalogWrites.index_manifest, "_writes")
    load = delegate(CatalogWrites.load, "_writes")
    seed_hints = delegate(CatalogWrites.seed_hints, "_writes")
    set_hint = delegate(CatalogWrites.set_hint, "_writes")
    update_index = delegate(CatalogWrites.update_index, "_writes")
    touch = delegate(CatalogWrites.touch, "_writes")
    clamp_future_access = delegate(CatalogWrites.clamp_future_access, "_writes")
    next_generation = delegate(CatalogWrites.next_generation, "_writes")
    release_sealed = delegate(CatalogWrites.release_sealed, "_writes")
    delete_entries = delegate(CatalogWrites.delete_entries, "_writes")

    # -- queries (``reads``) ------------------------------------------------------------

    get = delegate(CatalogReads.get, "_reads")
    live = delegate(CatalogReads.live, "_reads")
    manifest_sizes = delegate(CatalogReads.manifest_sizes, "_reads")
    freed_by = delegate(CatalogReads.freed_by, "_reads")
    live_keys = delegate(CatalogReads.live_keys, "_reads")
    resolve_prefix = delegate(CatalogReads.resolve_prefix, "_reads")
    released_page = delegate(CatalogReads.released_page, "_reads")
    malformed = delegate(CatalogReads.malformed, "_reads")
    raw_row = delegate(CatalogReads.raw_row, "_reads")
    malformed_count = delegate(CatalogReads.malformed_count, "_reads")
    iter_ids_after = delegate(CatalogReads.iter_ids_after, "_reads")
    pending = delegate(CatalogReads.pending, "_reads")
    totals = delegate(CatalogReads.totals, "_reads")
    by_kind = delegate(CatalogReads.by_kind, "_reads")
    released_stats = delegate(CatalogReads.released_stats, "_reads")
    eviction_order = delegate(CatalogReads.eviction_order, "_reads")
    all_entry_ids = delegate(CatalogReads.all_entry_ids, "_reads")
    all_digests = delegate(CatalogReads.all_digests, "_reads")
    sealed_counts = delegate(CatalogReads.sealed_counts, "_reads")
    # last: a class attribute named ``list`` hides the builtin from the annotations after it
    list = delegate(CatalogReads.list_rows, "_reads")
