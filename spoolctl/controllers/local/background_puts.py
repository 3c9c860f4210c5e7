"""Puts that finish after the prepare that staged them: the mid-prompt checkpoints.

A checkpoint only speeds up a later prompt, so its durable write (fsync of objects, manifest
and catalog row) stays off the request's path: the prepare serializes it and hands it here;
one worker thread per controller puts them in order. At most ``MAX_PENDING`` wait at once
(more are dropped: nothing is lost but a speed-up); ``close`` writes what waits, then stops.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from ..logsafe import reason

log = logging.getLogger("spoolctl.controllers")

MAX_PENDING = 32


class BackgroundPuts:
    """An ordered queue of staged puts served by one lazily started worker thread."""

    def __init__(self, put: Callable[[Any], object], *, max_pending: int = MAX_PENDING):
        self._put = put
        self._max = max_pending
        self._queue: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, staged: Any) -> bool:
        """Queue ``staged``; False (dropped) once closed or with ``max_pending`` waiting."""
        with self._lock:
            if self._closed or self._pending >= self._max:
                return False
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="spoolctl-checkpoints")
                self._thread.start()
        self._queue.put(staged)
        return True

    def _run(self) -> None:
        while (staged := self._queue.get()) is not None:
            try:
                self._put(staged)
            except Exception as exc:  # a checkpoint is a speed-up: never take a thread down
                log.warning("a checkpoint was not stored: %s", reason(exc))
            finally:
                with self._lock:
                    self._pending -= 1
                self._queue.task_done()
        self._queue.task_done()

    def drain(self) -> None:
        """Wait until every queued put has run."""
        self._queue.join()

    def close(self) -> None:
        """Run what waits, then stop the worker (idempotent)."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
