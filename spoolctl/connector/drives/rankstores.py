"""Rank stores opened by the connector in this process, shared and closed with their last user.

The scheduler and a worker of one process (vLLM's uni executor) use the same rank root:
the worker writes it, the scheduler reads its catalog at every lookup. They share one
``Store`` (one catalog connection, one set of lock files per process) through
``OPEN_STORES``: ``acquire`` opens a root or returns the open one and counts the user;
``release`` closes the store when its last user lets go (each role at its ``shutdown``).
"""

from __future__ import annotations

import contextlib
import logging
import threading

from spoolctl.store import Store, TagKey

log = logging.getLogger("spoolctl.connector")


class OpenStores:
    """Reference-counted ``Store`` objects by root path. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, tuple[Store, int]] = {}
        self._opening: dict[str, threading.Event] = {}  # roots being opened now

    def acquire(self, root: str, *, create: bool, max_bytes: int | None,
                tag_key: TagKey | None = None) -> Store:
        """The open store at ``root`` (opened now if needed: ``Store.open``'s errors), with
        ``tag_key`` (``ConnectorSettings.tag_key``: both roles pass the same one). The lock
        is not held while a store opens (a hung disk would stop every other root's
        users); a second caller for the same root waits for that opening."""
        while True:
            with self._lock:
                held = self._open.get(root)
                if held is not None:
                    store, users = held
                    self._open[root] = (store, users + 1)
                    return store
                opening = self._opening.get(root)
                if opening is None:
                    mine = self._opening[root] = threading.Event()
            if opening is not None:
                opening.wait()
                continue
            try:
                # With a master key the store is encrypted: the connector names each
                # request's tenant (``tenancy``).
                store = Store.open(root, create=create, max_bytes=max_bytes, tag_key=tag_key)
            except BaseException:
                with self._lock:
                    del self._opening[root]
                mine.set()
                raise
            with self._lock:
                self._open[root] = (store, 1)
                del self._opening[root]
            mine.set()
            return store

    def release(self, store: Store) -> None:
        """One user is done with ``store``; the last one closes it."""
        with self._lock:
            root = next((r for r, (held, _) in self._open.items() if held is store), None)
            if root is None:
                return  # not ours (or already closed): nothing to do
            users = self._open[root][1]
            if users > 1:
                self._open[root] = (store, users - 1)
                return
            del self._open[root]
        with contextlib.suppress(Exception):  # closing is best effort at shutdown
            store.close()

    def roots(self) -> list[str]:
        """The roots open now (diagnostics and tests)."""
        with self._lock:
            return sorted(self._open)


OPEN_STORES = OpenStores()
