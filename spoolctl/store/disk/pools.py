"""Shared helper-thread pools made on first use, that still work at interpreter exit.

The store runs some work off the calling thread: fsyncs (a group commit's flushes overlap),
the hash of a large verified read (chunk i hashed while chunk i+1 is read) and the unlinks
of a clean. Each is one process-wide ``LazyPool``, created the first time it is used.

At interpreter exit ``concurrent.futures`` shuts every pool down from a
``threading._register_atexit`` hook, which runs *before* ``atexit`` handlers
(ENVIRONMENT.md): a pool then refuses new work ("cannot schedule new futures after
interpreter shutdown"), and one first made then refuses it too. A commit, verified read or
clean run from an ``atexit`` drain (the connector's, a controller's ``close``) must still
work, so a ``LazyPool`` that refuses work runs it on the calling thread instead: the same
result, only without the overlap. All pools behave alike here (before this module the
unlink pool raised instead; issue 28 item 8).
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
        """In a forked child (``status``/``metrics`` read each store in one, decision 2701):
        the parent's executor has no threads here, yet counts its idle workers, so work
        handed to it would wait forever (a marker rewrite in the child hung ``status`` until
        its disk deadline); the child makes its own pool at first use."""
        self._lock = threading.Lock()
        self._executor = None

    def executor(self) -> ThreadPoolExecutor:
        """The pool itself, made now if it was not yet (it may refuse work at exit)."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self.workers,
                                                    thread_name_prefix=self.name)
            return self._executor

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """``fn(*args)`` on the pool, or run here and now when the pool no longer accepts
        work (interpreter exit); either way a Future holding its result or exception."""
        try:
            return self.executor().submit(fn, *args)
        except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
            done: Future = Future()
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


def _results(futures: list[Future]) -> Iterator[Any]:
    try:
        for future in futures:
            yield future.result()
    finally:
        for future in futures:
            future.cancel()
