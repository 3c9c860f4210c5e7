"""Checkpointing a WAL database on a helper thread, between one writer's transactions.

SQLite's automatic checkpoint runs inside the ``COMMIT`` that crosses its threshold, so a
large deletion batch paid a whole checkpoint on the writer's thread. Here, after each write
transaction ``start`` hands a passive checkpoint to a helper thread, and the next write
first waits for it (``wait``): the writer's unlinks overlap it and the WAL stays one
transaction long. A checkpoint that fails is skipped; a later one copies those pages.
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
            pass  # skipped: a later checkpoint copies these pages

    def _close(self) -> None:
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None
