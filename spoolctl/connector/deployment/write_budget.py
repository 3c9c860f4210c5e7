"""A daily write budget per rank store (``spoolctl_write_budget``): what a drive may take.

The budget bounds the KV bytes one rank store commits per UTC day, so a write-heavy cache
cannot wear out an SSD rated for so many drive writes per day. Reads are never limited.

* ``WriteLedger`` (worker): the store writer ``take``s each chunk's bytes before committing
  it and ``refund``s them when the commit fails; a chunk that does not fit is skipped
  (reason ``write_budget``), nothing waits. Once ``spent``, nothing is even captured.
  Persisted in ``<deployment dir>/write-budget-rank-NNNN.json`` (``ledger_path``),
  charged ahead in slabs of ``SLAB_SHARE`` so a crash never under-counts (at most one slab
  over); a new UTC day starts at zero.
* ``BudgetWatch`` (scheduler): reads the ledgers of the rank stores on its host off its
  thread; ``effective_after`` turns the share left into the sightings admission asks for.
  A rank on several drives pools its drives' ledgers; the tightest rank decides.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from spoolctl.store import fsync_dir, write_tmp

log = logging.getLogger("spoolctl.connector")

SCHEMA = "spoolctl-write-budget/v1"
PREFIX = "write-budget-"
# The count is charged ahead by this share of the budget at a time: one small file write
# (and fsync) per 1% of the day's budget, and a crash overstates the count by at most that.
SLAB_SHARE = 0.01
# (share of the day's budget left, sightings added to spoolctl_admit_after) from the
# lowest; above the first share the configured rule applies unchanged.
TIGHTEN = ((0.10, 3), (0.25, 2), (0.50, 1))


def utc_day(now: float) -> str:
    """The UTC calendar day of Unix time ``now`` (the budget's period), ``YYYY-MM-DD``."""
    return time.strftime("%Y-%m-%d", time.gmtime(now))


def ledger_path(store_root: str | Path) -> Path:
    """Where the ledger of the rank store at ``store_root`` (``.../<deployment>/rank-NNNN``)
    lives: beside it, in the deployment directory (the store's own format is untouched)."""
    root = Path(store_root)
    return root.parent / f"{PREFIX}{root.name}.json"


@dataclass(frozen=True)
class LedgerState:
    """Bytes counted against ``budget`` on ``day`` (UTC)."""

    day: str
    used: int
    budget: int

    def used_today(self, now: float) -> int:
        """``used`` if ``day`` is today, else 0 (the budget restarts every UTC day)."""
        return self.used if self.day == utc_day(now) else 0

    def left_share(self, now: float) -> float:
        """The share of today's budget not yet used (0.0 when spent)."""
        return max(0.0, 1.0 - self.used_today(now) / self.budget) if self.budget > 0 else 0.0

    def to_json(self, now: float) -> dict[str, int | float | str]:
        used = self.used_today(now)
        return {"day": utc_day(now), "used_bytes": used, "budget_bytes": self.budget,
                "left_pct": round(100 * self.left_share(now), 1)}


class LedgerError(ValueError):
    """The ledger file exists but cannot be used (the message names the file and the fix)."""


_FIX = ("the engine rewrites it at its next write; delete it only to forget today's count")


def read(path: Path) -> LedgerState | None:
    """The ledger at ``path``; None when there is none; ``LedgerError`` when it cannot be
    read or is not a ledger (bounded, non-blocking, never through a symlink)."""
    from .description import read_record

    doc = read_record(path, SCHEMA, {"day": (str,), "used": (int,), "budget": (int,)},
                      "a write budget ledger", _FIX, error=LedgerError)
    if doc is None:
        return None
    if doc["used"] < 0 or doc["budget"] <= 0 or len(doc["day"]) != 10:
        raise LedgerError(f"{path} is not a write budget ledger; {_FIX}")
    return LedgerState(doc["day"], doc["used"], doc["budget"])


def effective_after(after: int, left_share: float) -> int | None:
    """Sightings a chunk needs before it is stored with ``left_share`` of the day's budget
    left: ``after`` (the configured rule) while half or more is left, one more below
    50%, two below 25%, three below 10%; None once it is spent (store nothing)."""
    if left_share <= 0:
        return None
    for share, extra in TIGHTEN:
        if left_share < share:
            return after + extra
    return after


class WriteLedger:
    """The worker's count of bytes written today against ``budget`` (thread-safe). Loads
    the ledger at ``path`` (a damaged or unreadable one is treated as a spent budget for
    today, with a warning: wear is not risked on a count that cannot be read)."""

    def __init__(self, path: Path, budget: int, *, clock: Callable[[], float] = time.time):
        if budget <= 0:
            raise ValueError("budget must be positive")
        self.path = path
        self.budget = budget
        self._clock = clock
        self._lock = threading.Lock()
        self._slab = max(1, int(budget * SLAB_SHARE))
        self._warned = False
        today = utc_day(clock())
        try:
            state = read(path)
        except LedgerError as exc:
            log.warning("spoolctl: %s; no KV is written today", exc)
            state = LedgerState(today, budget, budget)
        self._day = today
        self._used = state.used if state is not None and state.day == today else 0
        self._charged = self._used  # what the file says (at least what was written)

    # -- the count ------------------------------------------------------------------------------

    def _roll(self) -> None:
        today = utc_day(self._clock())
        if today != self._day:
            self._day, self._used, self._charged = today, 0, 0

    @property
    def spent(self) -> bool:
        """Nothing more can be written today. Never takes the lock (``take`` may hold it
        while its record waits on a slow disk): the forward path checks it."""
        day, used = self._day, self._used
        return day == utc_day(self._clock()) and used >= self.budget

    def state(self) -> LedgerState:
        """Today's count (lock-free, like ``spent``)."""
        day, used = self._day, self._used
        return LedgerState(day, used, self.budget)

    def take(self, nbytes: int) -> bool:
        """Count ``nbytes`` about to be written; False (nothing counted) if they do not fit
        in today's budget. Records the next slab first when the count passes the recorded
        charge, so the file never says less than was written (see the module docstring)."""
        with self._lock:
            self._roll()
            if self._used + nbytes > self.budget:
                return False
            self._used += nbytes
            if self._used > self._charged:
                charge = min(self.budget, self._used + self._slab)
                if self._record(charge):
                    self._charged = charge
                else:
                    # Never written past a count that is not on disk: give it back.
                    self._used -= nbytes
                    return False
            return True

    def refund(self, nbytes: int) -> None:
        """``nbytes`` taken were not written after all (the commit failed)."""
        with self._lock:
            self._used = max(0, self._used - nbytes)

    def close(self) -> None:
        """Record the exact count (a clean shutdown)."""
        with self._lock:
            self._roll()
            if self._used != self._charged and self._record(self._used):
                self._charged = self._used

    def _record(self, used: int) -> bool:
        """Write the ledger atomically (called with the lock held); False on failure."""
        directory = self.path.parent
        try:
            if not stat.S_ISDIR(os.lstat(directory).st_mode):
                raise NotADirectoryError(str(directory))
            doc = {"schema": SCHEMA, "day": self._day, "used": int(used),
                   "budget": int(self.budget)}
            tmp, _, _ = write_tmp(directory, [json.dumps(doc, sort_keys=True).encode() + b"\n"])
            os.replace(tmp, self.path)
            fsync_dir(directory)
            return True
        except Exception as exc:
            if not self._warned:
                self._warned = True
                log.warning("spoolctl: could not record the write budget in %s: %s; "
                            "KV is not written until it can be", self.path,
                            getattr(exc, "message", exc))
            return False


def pooled_left_share(states: Sequence[LedgerState], now: float) -> float:
    """The share of today's budget left over one rank's drives: their bytes left today
    against their budgets, summed (0.0 when none has a budget)."""
    budget = sum(s.budget for s in states)
    left = sum(max(0, s.budget - s.used_today(now)) for s in states)
    return left / budget if budget > 0 else 0.0


# A ledger is a small file read in milliseconds; a read still running after this long is
# on a hung drive, and the round goes on without it.
LEDGER_READ_BOUND_S = 1.0


class BudgetWatch:
    """The scheduler's view of the ledgers of the rank stores on its host: the smallest
    share of the day's budget left over the ranks (``left_share``), each rank's pooled over
    its drives (``pooled_left_share``). ``paths()`` lists, per rank, its ledger path or its
    drives' ledger paths. Read on a daemon thread at most every ``interval`` seconds, each
    ledger waited for at most ``read_bound`` (a hung read keeps its last value and is not
    restarted); until the first read the budget counts as untouched. A missing or
    unreadable ledger is left out of its rank's sum."""

    def __init__(self, paths: Callable[[], Sequence[Path | Sequence[Path]]], *,
                 interval: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 read_bound: float = LEDGER_READ_BOUND_S):
        self._paths = paths
        self._interval = interval
        self._read_bound = read_bound
        self._clock, self._wall = clock, wall
        self._read_at = float("-inf")
        self._busy = threading.Lock()
        self._states: list[list[LedgerState]] = []  # per rank with a ledger: its drives'
        self._lock = threading.Lock()  # guards _last and _reading
        self._last: dict[Path, LedgerState | None] = {}  # each ledger's last value read
        self._reading: dict[Path, threading.Event] = {}  # reads still running: set when done

    def left_share(self) -> float:
        """The smallest share of today's budget left over the ranks read last (1.0 when
        none was read yet); starts a new read when one is due."""
        now = self._clock()
        if now - self._read_at >= self._interval and self._busy.acquire(blocking=False):
            self._read_at = now
            threading.Thread(target=self._read, name="spoolctl-budget", daemon=True).start()
        wall = self._wall()
        return min((pooled_left_share(rank, wall) for rank in self._states), default=1.0)

    def refresh(self) -> None:
        """Read the ledgers now, on the caller's thread (tests, start-up), each within
        ``read_bound``; the next round ``left_share`` starts is due ``interval`` later."""
        with self._busy:
            self._read_at = self._clock()
            self._read_states()

    @property
    def reads_running(self) -> int:
        """Ledger reads still running (each on a drive that has not answered yet)."""
        with self._lock:
            return len(self._reading)

    def _read(self) -> None:
        try:
            self._read_states()
        finally:
            self._busy.release()

    def _read_states(self) -> None:
        listed = [[paths] if isinstance(paths, Path) else list(paths)
                  for paths in self._paths()]
        started = [self._start(path) for rank in listed for path in rank]
        end = time.monotonic() + self._read_bound
        for done in started:
            if done is not None:
                done.wait(max(0.0, end - time.monotonic()))
        with self._lock:
            last = dict(self._last)
        states = []
        for rank in listed:
            got = [state for path in rank if (state := last.get(path)) is not None]
            if got:
                states.append(got)
        self._states = states

    def _start(self, path: Path) -> threading.Event | None:
        """Start reading ``path`` on its own thread (None: a read of it is still running)."""
        with self._lock:
            if path in self._reading:
                return None
            done = self._reading[path] = threading.Event()

        def body() -> None:
            state: LedgerState | None = None
            try:
                state = read(path)
            except LedgerError as exc:
                log.debug("spoolctl: %s", exc)  # the worker treats it as spent and says so
            except OSError:
                pass
            finally:
                with self._lock:
                    self._last[path] = state
                    del self._reading[path]
                done.set()

        threading.Thread(target=body, name="spoolctl-budget-read", daemon=True).start()
        return done
