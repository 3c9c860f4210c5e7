"""Keeping a slow or failing disk off the serving path: deadlines, and taking a sick store out.

A cache must never be worse than no cache. Every read the connector does for a request
has a deadline; past it the chunk is a miss (vLLM recomputes it) and the late read, when it
completes, is dropped. A store whose reads keep missing their deadline or failing with an
I/O error is taken out: the connector stops reading it (its lookups are misses, its
restores fail at once, nothing waits on it), probes it in the background and uses it again
when it answers.

``DiskGuard`` (one per open ``Store`` in a process, shared by the scheduler and a
same-process worker: ``guard_for``) is that policy:

* ``call(fn)``: run ``fn`` (a catalog read at lookup) on the guard's own thread and wait
  at most ``deadline_s``; ``(True, result)`` or ``(False, None)`` (late, failed, or the
  store is down). One call at a time: a new call waits for an earlier one within its own
  deadline and fails if it is still stuck, so a hung disk never queues threads or memory.
  A late result is dropped when it arrives.
* ``spare(fn)``: run ``fn`` (an LRU touch) only if the thread is idle; never waits.
* ``failed(kind)`` / ``ok(kind)``: what the serving path saw, per kind of read (``lookup``:
  the catalog; ``restore``: manifests and objects; ``commit``: a commit that failed with a
  disk error). ``FAILURES_TO_DOWN`` failures of one
  kind in a row (no good read *of that kind* between) take the store down (``down``, one
  warning): a catalog that answers from the page cache says nothing about objects that
  hang. A probe thread then reads the root marker, the catalog and one
  object past the page cache every ``probe_interval_s`` under 4x the deadline, and the
  first probe that answers in time brings the store back (logged).
* ``stuck(kind, still)``: an operation that cannot fail a second time because it never
  ends (a commit holding its writer's one thread past its bound) takes the
  store out at once, and the probe does not bring it back while ``still()`` is True.

An I/O error is not proof of corruption (a sector that fails today may read tomorrow, a
mount may come back): it counts here as a failure, the chunk is a miss, nothing is
quarantined (``Store.manifest`` / ``Store.read`` raise ``StoreIOError`` for it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, wait
from functools import partial
from typing import Any

from spoolctl.errors import StoreIOError
from spoolctl.store import MARKER, Store

log = logging.getLogger("spoolctl.connector")

# Defaults: a lookup blocks vLLM's scheduler (every request waits), so its
# catalog read gets little time; a restore blocks only its own request.
DEFAULT_LOOKUP_DEADLINE_S = 0.5
DEFAULT_READ_DEADLINE_S = 5.0
DEFAULT_PROBE_INTERVAL_S = 5.0
FAILURES_TO_DOWN = 3


class DiskGuard:
    """See the module docstring. Thread-safe."""

    def __init__(self, store: Store, *, deadline_s: float = DEFAULT_LOOKUP_DEADLINE_S,
                 probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
                 failures_to_down: int = FAILURES_TO_DOWN):
        self._store = weakref.ref(store)
        self._root = str(store.root)
        self.deadline_s = deadline_s
        self.probe_interval_s = probe_interval_s
        self.failures_to_down = failures_to_down
        self._lock = threading.Lock()
        self._busy: Future | None = None  # the call on the guard's thread, if any
        self._failures: dict[str, int] = {}  # kind of read -> failures in a row
        self._down_since: float | None = None
        # why it was taken out, for people (``out_of_service`` records it); None while up
        self.reason: str | None = None
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None
        self._listeners: list[Callable[[bool], None]] = []
        self._holds: list[Callable[[], bool]] = []  # ``stuck`` operations still running
        self.downs = 0  # times the store was taken out (diagnostics)

    def listen(self, on_change: Callable[[bool], None]) -> None:
        """Call ``on_change(down)`` whenever the store is taken out or comes back (outside
        the guard's lock, on the thread that saw it: a reader's or the probe's, never
        expected to be the engine's; several drives)."""
        with self._lock:
            self._listeners.append(on_change)

    def _tell(self, down: bool) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for fn in listeners:
            try:
                fn(down)
            except Exception:  # a listener's bug must not stop the guard
                log.exception("spoolctl: disk state listener failed")

    # -- health --------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """``close`` was called: no more probes."""
        return self._stop.is_set()

    @property
    def down(self) -> bool:
        """The store is out of service: do not read it for a request."""
        return self._down_since is not None

    def ok(self, kind: str = "lookup") -> None:
        """A read of ``kind`` for a request answered in time."""
        with self._lock:
            self._failures[kind] = 0

    def failed(self, kind: str = "lookup") -> None:
        """A read of ``kind`` for a request missed its deadline or failed with an I/O
        error. Only a good read of the same kind resets the count."""
        with self._lock:
            self._failures[kind] = self._failures.get(kind, 0) + 1
            if self._down_since is not None or \
                    self._failures[kind] < self.failures_to_down:
                return
            self._down_since = time.monotonic()
            self.reason = f"{self.failures_to_down} {kind} reads late or failed in a row"
            self.downs += 1
            self._start_probe()
        self._tell(True)
        log.warning("spoolctl: store disk not answering in time (%d %s reads late or failed "
                    "in a row); serving without it (cold prefill) and probing every %.0f s: %s",
                    self.failures_to_down, kind, self.probe_interval_s, self._root)

    def stuck(self, kind: str, still: Callable[[], bool]) -> None:
        """An operation of ``kind`` is past its bound and still running (a hung commit):
        take the store out now, since the one thread it holds will never report a second
        failure, and keep it out while ``still()`` is True (called by the probe, memory
        only): the probe brings it back once the operation ended and the disk answers."""
        with self._lock:
            self._holds.append(still)
            if self._down_since is not None:
                return
            self._down_since = time.monotonic()
            self.reason = f"a {kind} still running past its bound"
            self.downs += 1
            self._start_probe()
        self._tell(True)
        log.warning("spoolctl: store disk not answering in time (a %s still running past "
                    "its bound); serving without it (cold prefill) and probing every %.0f s: "
                    "%s", kind, self.probe_interval_s, self._root)

    def _held(self) -> bool:
        """Some ``stuck`` operation is still running (those that ended are forgotten)."""
        with self._lock:
            holds = list(self._holds)
        still = [h for h in holds if h()]
        with self._lock:
            self._holds = [h for h in self._holds if h not in holds or h in still]
        return bool(still)

    def close(self) -> None:
        """Stop probing (the store is being closed)."""
        self._stop.set()

    # -- calls with a deadline -----------------------------------------------------------------

    def call(self, fn: Callable[[], Any], deadline_s: float | None = None
             ) -> tuple[bool, Any]:
        """``fn()`` within the deadline: ``(True, result)``, else ``(False, None)`` (counted
        as a failure unless the store was already down). Errors other than the disk's
        (``OSError``, ``StoreIOError``) are raised, and count for nothing."""
        if self.down:
            return False, None
        done, result = self._run(fn, self.deadline_s if deadline_s is None else deadline_s)
        if done:
            self.ok()
        else:
            self.failed()
        return done, result

    def spare(self, fn: Callable[[], Any]) -> bool:
        """Start ``fn()`` if the guard's thread is idle and the store up; never waits."""
        if self.down:
            return False
        with self._lock:
            if self._busy is not None:
                return False
            self._busy = self._start(fn)
        return True

    def _run(self, fn: Callable[[], Any], deadline_s: float) -> tuple[bool, Any]:
        end = time.monotonic() + deadline_s
        with self._lock:
            busy = self._busy
        if busy is not None:
            # An earlier call (a touch, or a read still on the disk): wait for it within
            # this call's deadline, never longer, and never queue behind it.
            wait([busy], timeout=deadline_s)
        with self._lock:
            if self._busy is not None:  # still on the disk (or another caller got in)
                return False, None
            fut = self._busy = self._start(fn)
        try:
            return True, fut.result(timeout=max(0.0, end - time.monotonic()))
        except TimeoutError:
            return False, None  # late: its result is dropped when it arrives
        except (OSError, StoreIOError) as exc:  # the disk failed: never raised into vLLM
            log.debug("spoolctl: store read failed: %s", exc)
            return False, None

    def _start(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on a fresh daemon thread (one at a time: ``_busy``); a thread stuck in
        the kernel cannot be stopped, and a daemon never holds up interpreter exit."""
        fut: Future = Future()

        def body() -> None:
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn()
            except BaseException as exc:
                error = exc
            # Free the slot before the waiter wakes: its next call must find it free.
            with self._lock:
                if self._busy is fut:
                    self._busy = None
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        threading.Thread(target=body, name="spoolctl-disk", daemon=True).start()
        return fut

    # -- the probe -----------------------------------------------------------------------------

    def _start_probe(self) -> None:
        if self._prober is None or not self._prober.is_alive():
            self._prober = threading.Thread(target=self._probe_loop, name="spoolctl-probe",
                                            daemon=True)
            self._prober.start()

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.probe_interval_s):
            if self._held():  # a hung commit still holds its writer: not back yet
                continue
            store = self._store()
            if store is None:
                return
            done, _ = self._run(partial(probe, store), self.deadline_s * 4)
            del store
            if done and not self._held():
                with self._lock:
                    since, self._down_since = self._down_since, None
                    self.reason = None
                    self._failures.clear()
                log.warning("spoolctl: store disk answers again after %.0f s; using it: %s",
                            time.monotonic() - (since or time.monotonic()), self._root)
                self._tell(False)
                return


def probe(store: Store) -> None:
    """One small read of each kind a request does: the root marker (a file), the catalog
    and an object. Raises on an I/O error."""
    fd = os.open(os.path.join(store.root, MARKER), os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.read(fd, 4096)
    finally:
        os.close(fd)
    store.live([])
    store.live(["0" * 64])
    probe_object(os.path.join(store.root, "objects"))


def probe_object(objects: str) -> None:
    """Read the first page of one object under ``objects`` from the disk itself: a hot
    catalog and marker answer from the page cache while the device hangs, so the page is
    dropped from the cache first (``POSIX_FADV_DONTNEED``; a clean page, nothing is lost).
    An empty store, or an object removed meanwhile, is an answer too."""
    try:
        with os.scandir(objects) as fans:
            fan = next((e.path for e in fans if e.is_dir(follow_symlinks=False)), None)
        if fan is None:
            return
        with os.scandir(fan) as names:
            path = next((e.path for e in names if e.is_file(follow_symlinks=False)), None)
        if path is None:
            return
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    try:
        os.posix_fadvise(fd, 0, 4096, os.POSIX_FADV_DONTNEED)
        os.pread(fd, 4096, 0)
    finally:
        os.close(fd)


def bounded(fn: Callable[[], Any], bound_s: float, *, name: str = "spoolctl-disk"
            ) -> tuple[bool, Any]:
    """``fn()`` on a fresh daemon thread, waited for at most ``bound_s``: ``(True, result)``,
    or ``(False, None)`` when it is still running (a disk that hangs; the thread ends when
    the disk answers, and its result is dropped). ``fn``'s exceptions are raised here."""
    fut: Future = Future()

    def body() -> None:
        try:
            fut.set_result(fn())
        except BaseException as exc:
            fut.set_exception(exc)

    threading.Thread(target=body, name=name, daemon=True).start()
    try:
        return True, fut.result(timeout=bound_s)
    except TimeoutError:
        return False, None


_GUARDS: weakref.WeakKeyDictionary[Store, DiskGuard] = weakref.WeakKeyDictionary()
_GUARDS_LOCK = threading.Lock()


def guard_for(store: Store, **settings: float) -> DiskGuard:
    """The guard of ``store`` in this process (created with ``settings`` on first use), so
    the scheduler and a worker that share a store share its health."""
    with _GUARDS_LOCK:
        guard = _GUARDS.get(store)
        if guard is None:
            guard = _GUARDS[store] = DiskGuard(store, **settings)  # type: ignore[arg-type]
        return guard
