"""A store query with a deadline, for the tier's lookups (pure; no vLLM).

vLLM answers a request's lookup only once the tier's lookup thread does (RETRY until then):
a query stuck on a hung disk would hold that request forever. ``BoundedCall`` runs the
query on its own thread and waits ``deadline`` seconds; past it the caller gets the
fallback (a miss: the chunks are recomputed), and while that late query is still stuck,
every new call gets the fallback at once instead of queueing behind it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("spoolctl.connector")
T = TypeVar("T")
_Job = tuple[Callable[[], Any], threading.Event, list[Any]]


class BoundedCall:
    """Calls from one thread at a time (the tier's lookup thread)."""

    def __init__(self, deadline: float, name: str) -> None:
        self._deadline = deadline
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._late: threading.Event | None = None  # set once the stuck call returns
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def stuck(self) -> bool:
        """True while a call that missed its deadline has not returned."""
        return self._late is not None and not self._late.is_set()

    def __call__(self, fn: Callable[[], T], fallback: T) -> T:
        """``fn()`` if it returns within the deadline, else ``fallback``."""
        if self.stuck:
            return fallback
        if self._late is not None:
            self._late = None
            log.warning("spoolctl tier: the store answers again; lookups resume")
        done, box = threading.Event(), list[Any]()
        self._jobs.put((fn, done, box))
        if not done.wait(self._deadline):
            self._late = done
            log.warning("spoolctl tier: a lookup passed its %.0f s deadline (a slow or hung "
                        "disk); lookups are misses until the store answers", self._deadline)
            return fallback
        [result] = box
        if isinstance(result, BaseException):
            raise result
        return result  # type: ignore[no-any-return]

    def close(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, done, box = job
            try:
                box.append(fn())
            except Exception as exc:  # re-raised on the caller's thread
                box.append(exc)
            done.set()
