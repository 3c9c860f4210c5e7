"""Single-flight of ``prepare``: concurrent identical calls share one piece of work.

Used by every controller (the local engine and the GenAI controller), from threads
and asyncio tasks alike. The rules, written once here:

* A flight is keyed by ``(key, read_only)``. The first caller of a key leads: it does
  the work and publishes the handle (or the exception) to everyone who joined.
* A writing prepare joins only a writing flight (a read-only flight may end in the
  empty handle, which a writer must not take for its own). A read-only prepare joins
  a writing flight of the same key if there is one (it then gets the entry the writer
  made without writing anything itself), else a read-only one.
* A joiner's handle is the leader's with ``source="coalesced"`` (the empty handle
  stays empty) and ``written_tokens = reused_tokens = computed_tokens = 0``: the joiner
  wrote, reused and computed nothing itself, so usage summed over callers counts the
  work once.
* A joiner is counted when it joins (not when the leader finishes), so a caller can
  see how many are waiting.

The flights live under the controller's own ``threading.Condition``: ``join`` and
``wait_idle`` must be called with it held, ``lead``/``finish`` take it themselves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass

from .contract import CacheHandle


@dataclass(frozen=True)
class Flight:
    """One caller's place in a flight: the leader does the work, the others wait."""

    key: tuple[str, bool]
    future: Future[CacheHandle]
    leader: bool


def coalesced(handle: CacheHandle) -> CacheHandle:
    """What a joiner gets from the leader's handle (see the module docstring)."""
    return dataclasses.replace(handle, written_tokens=0, reused_tokens=0, computed_tokens=0,
                               source="coalesced" if handle else handle.source)


class PrepareFlights:
    """The in-flight prepares of one controller, guarded by the controller's condition."""

    def __init__(self, cond: threading.Condition):
        self._cond = cond
        self._flights: dict[tuple[str, bool], Future[CacheHandle]] = {}

    def __len__(self) -> int:
        return len(self._flights)

    def join(self, key: str, read_only: bool) -> Flight:
        """Join the flight of ``key`` or start one (call with the condition held)."""
        joinable = ((key, False), (key, True)) if read_only else ((key, False),)
        for candidate in joinable:
            future = self._flights.get(candidate)
            if future is not None:
                return Flight(candidate, future, leader=False)
        future = Future()
        self._flights[(key, read_only)] = future
        return Flight((key, read_only), future, leader=True)

    def lead(self, flight: Flight, work: Callable[[], CacheHandle]) -> CacheHandle:
        """Run the leader's ``work`` and publish its outcome to the joiners."""
        try:
            handle = work()
        except BaseException as exc:
            self.finish(flight, exc=exc)
            raise
        self.finish(flight, result=handle)
        return handle

    async def alead(self, flight: Flight,
                    work: Callable[[], Awaitable[CacheHandle]]) -> CacheHandle:
        """``lead`` for asyncio: ``work()`` is awaited."""
        try:
            handle = await work()
        except BaseException as exc:
            self.finish(flight, exc=exc)
            raise
        self.finish(flight, result=handle)
        return handle

    def finish(self, flight: Flight, *, result: CacheHandle | None = None,
               exc: BaseException | None = None) -> None:
        """Publish the leader's outcome and end the flight."""
        if exc is not None:
            flight.future.set_exception(exc)
        else:
            flight.future.set_result(result)  # type: ignore[arg-type]
        with self._cond:
            if self._flights.get(flight.key) is flight.future:
                del self._flights[flight.key]
            self._cond.notify_all()

    @staticmethod
    def wait(flight: Flight) -> CacheHandle:
        """A joiner's handle, once the leader is done (its exception, if it failed)."""
        return coalesced(flight.future.result())

    @staticmethod
    async def await_(flight: Flight) -> CacheHandle:
        """``wait`` for asyncio: the event loop keeps running while the leader works."""
        return coalesced(await asyncio.wrap_future(flight.future))

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait (condition held) until no flight is left; False if ``timeout`` ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._flights:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._cond.wait(left)
        return True
