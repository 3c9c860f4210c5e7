"""Shared helper-thread pools made on first use, that still work at interpreter exit.

At interpreter exit ``concurrent.futures`` shuts every pool down before ``atexit``
handlers run, so a ``LazyPool`` that refuses work runs it on the calling thread instead:
a commit or clean from an ``atexit`` drain still works, only without the overlap.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class LazyPool:
    """A ``ThreadPoolExecutor`` of ``workers`` threads named ``name-N``, made on first use
    and kept for the life of the process (see the module docstring)."""

    def __init__(self, name: str, workers: int):
        self.name = name
        self.workers = workers
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        """In a forked child: the parent's executor has no threads here yet counts its idle
        workers, so work handed to it would wait forever; make a new pool at first use."""
        self._lock = threading.Lock()
        self._executor = None

    def executor(self) -> ThreadPoolExecutor:
        """The pool itself, made now if it was not yet (it may refuse work at exit)."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self.workers,
                                                    thread_name_prefix=self.name)
            return self._executor

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """``fn(*args)`` on the pool, or run here and now when the pool no longer accepts
        work (interpreter exit); either way a Future holding its result or exception."""
        try:
            return self.executor().submit(fn, *args)
        except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
            done: Future[Any] = Future()
            try:
                done.set_result(fn(*args))
            except BaseException as exc:
                done.set_exception(exc)
            return done

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any]) -> Iterator[Any]:
        """``Executor.map`` through ``submit``: every call is started now (each on the pool,
        or run here at exit), the results are yielded in order; closing the iterator early
        cancels the calls not yet started."""
        # not strict: like Executor.map, the shortest iterable ends it (callers pass
        # itertools.repeat for an argument shared by every call)
        futures = [self.submit(fn, *args) for args in zip(*iterables, strict=False)]
        return _results(futures)


def _results(futures: list[Future[Any]]) -> Iterator[Any]:
    try:
        for future in futures:
            yield future.result()
    finally:
        for future in futures:
            future.cancel()
