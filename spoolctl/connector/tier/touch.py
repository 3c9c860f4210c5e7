"""The tier's LRU touches: chunks vLLM reused move up the store's eviction order.

vLLM calls ``touch`` on the scheduler thread for chunks a request hit; a catalog write there
could wait on the store's lock, so ``Toucher`` only queues the keys and its own thread
hands them to the store (``Store.touch``: skipped when recent or when the catalog is busy).

Pure: no vLLM import.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from .keys import KIND, entry_key

if TYPE_CHECKING:
    from spoolctl.store import Store

log = logging.getLogger("spoolctl.connector")

# Keys waiting for the toucher thread; past it new touches are dropped (an LRU hint only).
MAX_PENDING = 65536


class Toucher:
    """Queues keys (``add``, any thread) and touches them on its own thread."""

    def __init__(self, touch: Callable[[list[bytes]], None],
                 max_pending: int = MAX_PENDING) -> None:
        self._touch = touch
        self._max = max_pending
        self._pending: dict[bytes, None] = {}  # insertion-ordered, no duplicates
        self._cond = threading.Condition()
        self._busy = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="spool_tier_touch",
                                        daemon=True)
        self._thread.start()

    def add(self, keys: Iterable[bytes]) -> None:
        """Queue ``keys`` for a touch; never blocks on the store."""
        with self._cond:
            if self._stopped:
                return
            for key in keys:
                if len(self._pending) >= self._max:
                    break
                self._pending[key] = None
            self._cond.notify()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every queued key was handed to the store; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout)

    def shutdown(self, timeout: float) -> bool:
        """Touch what is queued (up to ``timeout`` s) and stop; False if still busy."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._stopped)
                if not self._pending:
                    return
                keys, self._pending = list(self._pending), {}
                self._busy = True
            try:
                self._touch(keys)
            except Exception:  # an LRU hint: a failure must not stop later touches
                log.exception("spoolctl tier: touching %d chunks failed", len(keys))
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


def touch_in(store: Store, namespace: str) -> Callable[[list[bytes]], None]:
    """What ``Toucher`` calls for the tier's entries of ``namespace`` in ``store``."""

    def touch(keys: list[bytes]) -> None:
        store.touch([store.entry_id(KIND, namespace, entry_key(k)) for k in keys])

    return touch
