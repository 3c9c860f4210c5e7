"""Checkpointing a WAL database on a helper thread, between one writer's transactions.

SQLite's automatic checkpoint runs inside the ``COMMIT`` that crosses the threshold (1,000
pages): the committing thread copies every page of the write-ahead log back into the
database file and fsyncs both before it returns. A deletion batch of ``clean`` dirties
about 4,000 catalog pages, so every batch's commit paid a whole checkpoint, and the
catalog's share of a clean was mostly checkpointing (decision 1407).

``BackgroundCheckpoints`` moves that work off the writer's thread: after each write
transaction ``start`` hands a passive checkpoint to a helper thread (its own connection;
SQLite runs it without the GIL), and the next write transaction first ``wait``\\ s for it.
The writer's file work in between (unlinking manifests and objects) overlaps the
checkpoint, and because each checkpoint completes before the next write begins, SQLite
restarts the log at every write: the WAL stays the size of one transaction, as with
automatic checkpoints. Durability is unchanged: the catalog runs ``synchronous=NORMAL``,
where a transaction is durable once a checkpoint (or a later sync) has flushed the log,
whichever thread runs it.

A checkpoint that fails (busy, disk full, I/O) is skipped: the next one, or SQLite's
automatic checkpoint once the writer restores it, copies those pages later.
"""

from __future__ import annotations

import contextlib
import sqlite3
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ...errors import SpoolError
from .sqlite_files import connect_pinned


class BackgroundCheckpoints:
    """Passive checkpoints of the WAL database at ``path``, one at a time, on a helper
    thread. Not thread-safe: the one writer that owns it calls ``start``/``wait``."""

    def __init__(self, path: Path, *, timeout: float = 60):
        self._path = path
        self._timeout = timeout
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spoolctl-ckpt")
        self._db: sqlite3.Connection | None = None
        self._running: Future[None] | None = None
        self.done = 0  # checkpoints that completed (for tests and benchmarks)

    def start(self) -> None:
        """Checkpoint what the log holds now, on the helper thread (after a commit)."""
        self.wait()
        self._running = self._pool.submit(self._checkpoint)

    def wait(self) -> None:
        """Return once the checkpoint in flight, if any, is over (before a write)."""
        running, self._running = self._running, None
        if running is not None:
            running.result()

    def close(self) -> None:
        """Wait for the checkpoint in flight, then release the thread and connection."""
        try:
            self.wait()
        finally:
            self._pool.submit(self._close).result()
            self._pool.shutdown()

    def _checkpoint(self) -> None:
        try:
            if self._db is None:
                self._db = connect_pinned(self._path, timeout=self._timeout)
            self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            self.done += 1
        except (sqlite3.Error, SpoolError):
            pass  # skipped: a later checkpoint copies these pages (module docstring)

    def _close(self) -> None:
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None
