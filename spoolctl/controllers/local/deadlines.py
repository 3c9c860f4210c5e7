"""Deadlines on a local controller's store calls: a hung disk costs ``prepare`` one
deadline, then the controller runs without its store until the disk answers.

``StoreDeadlines.call(fn, deadline_s)`` runs ``fn`` (a lookup, an object read, a commit)
on a daemon thread and waits at most ``deadline_s``: ``(True, result)``, or
``(False, None)`` when it is late. An error ``fn`` raises is raised to the caller as it
would have been (the engine already turns store errors into misses). A late call stays on
the disk; while one does, the store is *down*: every further call returns ``(False, None)``
at once and starts nothing, so a hung disk holds at most the calls that were running when
it hung -- no queue of threads, no memory growth. The late call ending (the disk answered,
even with an error) brings the store back; its result is dropped.

The defaults are the connector's: 0.5 s for a lookup (catalog and
manifest), 5 s for reading an entry's objects and for a commit. A late commit is not
undone: it completes in the background when the disk comes back (the commit protocol makes
it all or nothing), the ``prepare`` that started it reports nothing written.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from spoolctl.errors import ConfigError

log = logging.getLogger("spoolctl.controllers")

#: The connector's defaults (``spoolctl.connector.diskguard``).
DEFAULT_LOOKUP_DEADLINE_S = 0.5
DEFAULT_READ_DEADLINE_S = 5.0


class StoreDeadlines:
    """See the module docstring. Thread-safe."""

    def __init__(self, *, lookup_deadline_s: float = DEFAULT_LOOKUP_DEADLINE_S,
                 read_deadline_s: float = DEFAULT_READ_DEADLINE_S):
        for name, value in (("lookup_deadline", lookup_deadline_s),
                            ("read_deadline", read_deadline_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or \
                    not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, not "
                                  f"{value!r}", fix=f"pass e.g. {name}=5, or leave it out")
        self.lookup_deadline_s = float(lookup_deadline_s)
        self.read_deadline_s = float(read_deadline_s)
        self._lock = threading.Lock()
        self._late: set[Future] = set()  # calls still on the disk past their deadline
        self._ended: set[Future] = set()  # calls whose fn returned, result not yet set
        self.downs = 0  # times the store was taken out (diagnostics, tests)

    @property
    def down(self) -> bool:
        """A call is still stuck on the disk past its deadline: do not use the store."""
        with self._lock:
            return bool(self._late)

    def call(self, fn: Callable[[], Any], deadline_s: float) -> tuple[bool, Any]:
        """``fn()`` within ``deadline_s``: see the module docstring."""
        with self._lock:
            if self._late:
                return False, None
        fut: Future = Future()

        def body() -> None:
            try:
                result = fn()
            except BaseException as exc:
                self._settle(fut, exc=exc)
            else:
                self._settle(fut, result=result)

        threading.Thread(target=body, name="spoolctl-controller-disk", daemon=True).start()
        try:
            return True, fut.result(timeout=deadline_s)
        except TimeoutError:
            with self._lock:
                ended = fut in self._ended or fut.done()
                if not ended:
                    self._late.add(fut)
                    first = len(self._late) == 1
                    self.downs += first
            if ended:  # it ended just now: not late after all
                return True, fut.result()
            if first:
                log.warning("spoolctl: the store's disk did not answer within %.1f s; "
                            "serving without it (cold prefills, nothing written) until it "
                            "does", deadline_s)
            return False, None

    def _settle(self, fut: Future, *, result: Any = None,
                exc: BaseException | None = None) -> None:
        with self._lock:
            was_late = fut in self._late
            self._late.discard(fut)
            back = was_late and not self._late
            if not was_late:
                self._ended.add(fut)
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
        with self._lock:
            self._ended.discard(fut)
        if back:
            log.warning("spoolctl: the store's disk answers again; using it")
