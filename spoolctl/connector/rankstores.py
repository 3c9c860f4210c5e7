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

    def acquire(self, root: str, *, create: bool, max_bytes: int | None,
                tag_key: TagKey | None = None) -> Store:
        """The open store at ``root`` (opened now if needed: ``Store.open``'s errors), with
        ``tag_key`` (``ConnectorSettings.tag_key``: both roles pass the same one)."""
        with self._lock:
            held = self._open.get(root)
            if held is None:
                # With a master key the store is encrypted: the connector names each
                # request's tenant (``tenancy``, decision 2801).
                store = Store.open(root, create=create, max_bytes=max_bytes, tag_key=tag_key)
                self._open[root] = (store, 1)
                return store
            store, users = held
            self._open[root] = (store, users + 1)
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
