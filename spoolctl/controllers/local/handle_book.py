"""What a local controller remembers of its ``prepare`` calls and the handles they returned.

A part of ``LocalCacheController``, sharing the controller's lock. Every
table is bounded (``MAX_KNOWN_PARAMS``), oldest forgotten first:

* the params and the work of each ``prepare`` call, by the handle's ``prepare_id``
  (``generate(handle)`` reports the work once, ``usage.py``), and the params last prepared
  for each ref (a handle from elsewhere, or one whose call was forgotten);
* the live handles holding each ref (weak references): a superseded base is released only
  once no live handle holds it;
* when a memory hit last moved each entry's LRU clock in the catalog: at most one catalog
  write per entry per ``MEMORY_TOUCH_INTERVAL``, never one per hit.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import weakref
from collections import OrderedDict

from ..contract import CacheHandle, CachePrepareParams
from .usage import PrepareWork

#: How often a memory hit moves an entry's LRU clock in the catalog (seconds).
MEMORY_TOUCH_INTERVAL = 60.0
MAX_KNOWN_PARAMS = 4096  # refs / prepare calls whose params generate(handle) can look up
#: One sequence for every controller of the process, so a handle of another controller
#: never matches a prepare call of this one.
_PREPARE_IDS = itertools.count(1)


class HandleBook:
    """The controller's memory of its calls and handles (see the module docstring).
    ``lock``: the controller's lock; ``hold``/``held`` expect it held by the caller."""

    def __init__(self, lock: threading.Condition):
        self._lock = lock
        self._params: OrderedDict[str, CachePrepareParams] = OrderedDict()
        self._calls: OrderedDict[int, tuple[CachePrepareParams, PrepareWork | None]] = \
            OrderedDict()
        self._holders: dict[str, list[weakref.ref[CacheHandle]]] = {}
        self._touched: dict[str, float] = {}

    def stamp(self, params: CachePrepareParams, handle: CacheHandle,
              work: PrepareWork | None) -> CacheHandle:
        """``handle`` with a new ``prepare_id``; remember the call's params and work."""
        prepare_id = next(_PREPARE_IDS)
        handle = dataclasses.replace(handle, prepare_id=prepare_id)
        with self._lock:
            self._calls[prepare_id] = (params, work)
            while len(self._calls) > MAX_KNOWN_PARAMS:
                self._calls.popitem(last=False)
            if handle.ref is not None:
                self.know(handle.ref, params)
                self.hold(handle)
        return handle

    def know(self, ref: str, params: CachePrepareParams) -> None:
        """Remember which params a ref was prepared for (for ``generate(handle)``); bounded."""
        with self._lock:
            self._params[ref] = params
            self._params.move_to_end(ref)
            while len(self._params) > MAX_KNOWN_PARAMS:
                self._params.popitem(last=False)

    def known(self, handle: CacheHandle) -> CachePrepareParams | None:
        """The params this controller prepared ``handle`` for (its own prepare call,
        else the last prepare of its ref), or None."""
        with self._lock:
            call = self._calls.get(handle.prepare_id) if handle.prepare_id else None
            if call is not None:
                return call[0]
            return self._params.get(handle.ref) if handle.ref else None

    def take_work(self, handle: CacheHandle) -> PrepareWork | None:
        """The work of ``handle``'s prepare call if not yet reported (then it is)."""
        prepare_id = handle.prepare_id
        if not prepare_id:
            return None
        with self._lock:
            call = self._calls.get(prepare_id)
            if call is None or call[1] is None:
                return None
            self._calls[prepare_id] = (call[0], None)
            return call[1]

    def forget_calls(self) -> None:
        """Forget every call and ref (the controller closes)."""
        with self._lock:
            self._params.clear()
            self._calls.clear()

    # -- supersession: only strict extensions, only once nobody holds the base --------------

    def hold(self, handle: CacheHandle) -> None:
        """Remember that ``handle`` (alive while its caller keeps it) holds its ref."""
        assert handle.ref is not None, "only a handle of an entry holds a ref"
        refs = self._holders.setdefault(handle.ref, [])
        refs[:] = [r for r in refs if r() is not None]
        refs.append(weakref.ref(handle))
        if len(self._holders) > MAX_KNOWN_PARAMS:
            for ref in [r for r in self._holders if not self.held(r)]:
                del self._holders[ref]

    def held(self, ref: str) -> bool:
        """Whether a live handle of this controller holds ``ref`` (call under the lock)."""
        refs = self._holders.get(ref)
        if not refs:
            return False
        refs[:] = [r for r in refs if r() is not None]
        return bool(refs)

    def drop_holders(self) -> None:
        """Forget every holder (call under the lock: the controller closes)."""
        self._holders.clear()

    # -- the LRU clock of memory hits --------------------------------------------------------

    def due_touch(self, entry_id: str) -> bool:
        """Whether a memory hit on ``entry_id`` should move its LRU clock in the catalog
        now (at most once per ``MEMORY_TOUCH_INTERVAL`` per entry; call under the lock)."""
        now = time.monotonic()
        if now - self._touched.get(entry_id, -MEMORY_TOUCH_INTERVAL) < MEMORY_TOUCH_INTERVAL:
            return False
        self._touched[entry_id] = now
        while len(self._touched) > MAX_KNOWN_PARAMS:
            self._touched.pop(next(iter(self._touched)))
        return True
