"""Deep scrub: re-read and verify every manifest and object at a bounded byte rate.

A *cycle* walks every catalog entry in id order. Progress lives in
``state/scrub.sqlite3`` (cursor = last entry finished, ``inflight`` = the entry
being verified), so a killed scrub resumes where it stopped:

* the cursor and the next ``inflight`` id are saved in one transaction before an
  entry is verified, so a crash mid-verify re-verifies that entry on resume even
  if its catalog row was already dropped by an interrupted quarantine (its
  manifest is then re-checked from disk and quarantined, never re-admitted);
* a failed entry is quarantined (its manifest and bad object moved out of the
  store, its catalog row dropped) before the cursor passes it;
* an object the scrubber cannot read (permissions, an I/O error) is recorded as an
  ``unreadable`` finding and the walk moves on: nothing is moved, so fixing the cause
  (``spoolctl doctor`` names it) makes the entry whole again. A scrub never stops at the
  same object on every run.

When the walk reaches the end, the cycle reclaims proven orphans (objects no
catalog row references, older than the cycle start, under the exclusive
maintenance lock so no commit is in flight) and abandoned temp files, and is
recorded as finished with what it authenticated and found.

Only one scrubber runs per store at a time: it holds ``state/scrub.lock``
exclusively while it works, so the CLI and a worker's background thread take
turns on the same cycle instead of fighting (``BusyError`` / skipped step).
"""

from __future__ import annotations

import contextlib
import logging
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from . import faults
from .errors import BusyError, CorruptionError, NotFoundError, QuarantineReason, StoreIOError
from .locks import try_hold
from .sqlite_files import DamagedDatabaseError, connect_private, connect_read_only, is_damaged
from .verify import failed_object, verify_object

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("spoolctl.store")

SCRUB_DB = "scrub.sqlite3"
_ID_OR_EMPTY = re.compile(r"(?:[0-9a-f]{64})?")
SCRUB_LOCK = "scrub.lock"
BATCH = 256
CHUNK = 1 << 20
# Temp files are only reclaimed this old (or when their writer is dead), whatever the
# cycle length: a live writer may take long to write a large object.
MIN_TMP_AGE = 3600.0
# Orphans must also be at least this old: filesystem timestamps are coarse (jiffies), so
# "older than the cycle start" alone could catch an object written just after it.
MIN_ORPHAN_AGE = 60.0
# The findings reason of an entry whose object could not be read (not a quarantine).
UNREADABLE = "unreadable"

_DDL = """
CREATE TABLE IF NOT EXISTS cycles(
    cycle_id INTEGER PRIMARY KEY AUTOINCREMENT,
    started REAL NOT NULL,
    finished REAL,
    total_at_start INTEGER NOT NULL,
    cursor TEXT NOT NULL DEFAULT '',
    inflight TEXT,
    checked INTEGER NOT NULL DEFAULT 0,
    bytes INTEGER NOT NULL DEFAULT 0,
    quarantined INTEGER NOT NULL DEFAULT 0,
    absent INTEGER NOT NULL DEFAULT 0,
    orphan_objects INTEGER NOT NULL DEFAULT 0,
    orphan_bytes INTEGER NOT NULL DEFAULT 0,
    tmp_files INTEGER NOT NULL DEFAULT 0,
    tmp_bytes INTEGER NOT NULL DEFAULT 0,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS findings(
    cycle_id INTEGER NOT NULL, entry_id TEXT NOT NULL, reason TEXT NOT NULL, time REAL NOT NULL
);
"""


@dataclass(frozen=True)
class Cycle:
    """One scrub cycle's recorded state (finished is None while in progress)."""

    cycle_id: int
    started: float
    finished: float | None
    total_at_start: int
    cursor: str
    inflight: str | None
    checked: int
    bytes: int
    quarantined: int
    absent: int
    orphan_objects: int
    orphan_bytes: int
    tmp_files: int
    tmp_bytes: int
    updated: float
    unreadable: int = 0  # entries with an object that could not be read (findings)

    @property
    def done(self) -> int:
        """Entries this cycle has passed, whatever their outcome."""
        return self.checked + self.quarantined + self.absent + self.unreadable

    def progress(self, total_now: int) -> float:
        """Fraction of the cycle done (by entries), 0..1."""
        if self.finished is not None:
            return 1.0
        denom = max(self.total_at_start, total_now, 1)
        return min(1.0, self.done / denom)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ScrubSummary:
    """What ``status`` shows: the last finished cycle and the one in progress."""

    last_cycle: Cycle | None
    current_cycle: Cycle | None
    last_findings: list[dict]

    def to_json(self, total_now: int) -> dict:
        cur = self.current_cycle
        return {
            "last_cycle": self.last_cycle.to_json() if self.last_cycle else None,
            "last_findings": self.last_findings,
            "current": None if cur is None else {
                **cur.to_json(), "progress": round(cur.progress(total_now), 4)},
        }


class ScrubState:
    """Typed access to ``state/scrub.sqlite3`` (one connection, one thread at a time)."""

    def __init__(self, path: Path, *, read_only: bool = False):
        self.path = path
        # NORMAL in WAL mode survives kill -9 (the case resumption is for); a power
        # cut may lose the last few progress saves, which only repeats some work.
        self._db = connect_read_only(path, ddl=_DDL) if read_only else \
            connect_private(path, ddl=_DDL, synchronous="NORMAL")

    @classmethod
    def of(cls, store: Store) -> ScrubState:
        return cls(store.layout.state / SCRUB_DB)

    @classmethod
    def summary_of(cls, store: Store) -> ScrubSummary:
        """Summary for status/metrics; an absent or unreadable scrub db reads as empty.
        Opened read-only: a reader never creates or changes the progress database."""
        if not (store.layout.state / SCRUB_DB).exists():
            return ScrubSummary(None, None, [])
        try:
            state = cls(store.layout.state / SCRUB_DB, read_only=True)
        except sqlite3.DatabaseError:
            return ScrubSummary(None, None, [])
        try:
            return state.summary()
        except sqlite3.DatabaseError:
            return ScrubSummary(None, None, [])
        finally:
            state.close()

    def close(self) -> None:
        self._db.close()

    def check(self) -> None:
        """Raise ``sqlite3.DatabaseError`` unless the file is sound and the open cycle's
        cursor and in-flight id are well formed (a corrupt page can read as a bogus row)."""
        result = self._db.execute("PRAGMA quick_check").fetchone()
        if not result or result[0] != "ok":
            raise DamagedDatabaseError(f"scrub state failed quick_check: {result}")
        cur = self.current()
        if cur is not None and not (
                isinstance(cur.started, float) and isinstance(cur.cursor, str)
                and _ID_OR_EMPTY.fullmatch(cur.cursor)
                and (cur.inflight is None or (isinstance(cur.inflight, str)
                                              and _ID_OR_EMPTY.fullmatch(cur.inflight)))):
            raise DamagedDatabaseError("scrub state holds a malformed cycle row")

    @classmethod
    def open_checked(cls, store: Store) -> ScrubState:
        """Open the progress database for a scrubber (which holds ``scrub.lock``).

        A corrupt or malformed database is quarantined (reason ``scrub_state``) and a
        fresh one started: progress is advisory, so the worst outcome is one cycle that
        starts over; every entry is still verified. Transient errors raise StoreIOError.
        """
        path = store.layout.state / SCRUB_DB
        try:
            state = cls(path)
            try:
                state.check()
            except BaseException:
                state.close()
                raise
            return state
        except sqlite3.DatabaseError as exc:
            if not is_damaged(exc):
                raise StoreIOError(f"scrub state unavailable: {exc}", path=path,
                                   fix="check free space and the disk (`spoolctl doctor`)"
                                   ) from None
            why = f"scrub state unreadable: {exc}"
        files = [(path.with_name(SCRUB_DB + suffix), "scrub_state")
                 for suffix in ("", "-wal", "-shm")]
        store.quarantine.add(QuarantineReason.SCRUB_STATE, why, files)
        log.warning("scrub progress database quarantined and reset: %s", why)
        return cls(path)

    def _cycle(self, where: str) -> Cycle | None:
        row = self._db.execute(
            "SELECT cycle_id, started, finished, total_at_start, cursor, inflight, checked, "
            "bytes, quarantined, absent, orphan_objects, orphan_bytes, tmp_files, tmp_bytes, "
            f"updated FROM cycles WHERE {where} ORDER BY cycle_id DESC LIMIT 1").fetchone()
        if not row:
            return None
        # Unreadable entries are counted from their findings: no schema change, so an
        # older progress database (or a read-only one) reads the same way.
        (unreadable,) = self._db.execute(
            "SELECT COUNT(*) FROM findings WHERE cycle_id=? AND reason=?",
            (row[0], UNREADABLE)).fetchone()
        return Cycle(*row, unreadable=unreadable)

    def current(self) -> Cycle | None:
        return self._cycle("finished IS NULL")

    def last_finished(self) -> Cycle | None:
        return self._cycle("finished IS NOT NULL")

    def findings(self, cycle_id: int, limit: int = 100) -> list[dict]:
        return [
            {"entry_id": e, "reason": r, "time": t} for e, r, t in self._db.execute(
                "SELECT entry_id, reason, time FROM findings WHERE cycle_id=? ORDER BY time "
                "LIMIT ?", (cycle_id, limit))
        ]

    def summary(self) -> ScrubSummary:
        last = self.last_finished()
        return ScrubSummary(last, self.current(), self.findings(last.cycle_id) if last else [])

    def start_cycle(self, now: float, total: int) -> Cycle:
        self._db.execute(
            "INSERT INTO cycles(started, total_at_start, updated) VALUES (?, ?, ?)",
            (now, total, now))
        cycle = self.current()
        assert cycle is not None
        return cycle

    def save(self, cycle_id: int, *, cursor: str, inflight: str | None, checked: int = 0,
             nbytes: int = 0, quarantined: int = 0, absent: int = 0) -> None:
        """Advance the cursor, set the next in-flight entry, add counts (one transaction)."""
        self._db.execute(
            "UPDATE cycles SET cursor=?, inflight=?, checked=checked+?, bytes=bytes+?, "
            "quarantined=quarantined+?, absent=absent+?, updated=? WHERE cycle_id=?",
            (cursor, inflight, checked, nbytes, quarantined, absent, time.time(), cycle_id))

    def add_finding(self, cycle_id: int, entry_id: str, reason: str) -> None:
        self._db.execute("INSERT INTO findings VALUES (?, ?, ?, ?)",
                         (cycle_id, entry_id, reason, time.time()))

    def finish(self, cycle_id: int, *, orphan_objects: int, orphan_bytes: int, tmp_files: int,
               tmp_bytes: int) -> None:
        now = time.time()
        self._db.execute(
            "UPDATE cycles SET finished=?, inflight=NULL, orphan_objects=?, orphan_bytes=?, "
            "tmp_files=?, tmp_bytes=?, updated=? WHERE cycle_id=?",
            (now, orphan_objects, orphan_bytes, tmp_files, tmp_bytes, now, cycle_id))
        # Keep a bounded history: the last 100 cycles and their findings.
        self._db.execute("DELETE FROM findings WHERE cycle_id <= ?", (cycle_id - 100,))
        self._db.execute("DELETE FROM cycles WHERE cycle_id <= ?", (cycle_id - 100,))


@dataclass
class ScrubReport:
    """What one scrub run did."""

    cycle_id: int = 0
    checked: int = 0
    bytes: int = 0
    absent: int = 0
    quarantined: list[dict] = field(default_factory=list)
    unreadable: list[dict] = field(default_factory=list)
    cycle_completed: bool = False
    resumed: bool = False
    orphans: dict = field(default_factory=dict)
    tmp: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


class RateLimiter:
    """Token-bucket pacing: ``consume(n)`` sleeps so the long-run rate stays <= rate."""

    def __init__(self, rate: int | None, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, burst: int = CHUNK):
        self.rate = rate
        self._clock = clock
        self._sleep = sleep
        # At most one second's worth (or one chunk) may go unpaced; a new limiter starts
        # empty so even a short run stays under the rate.
        self._burst = min(burst, rate) if rate else burst
        self._allowance = 0.0
        self._last = clock()

    def consume(self, n: int) -> None:
        if not self.rate:
            return
        now = self._clock()
        self._allowance = min(self._allowance + (now - self._last) * self.rate, self._burst)
        self._last = now
        self._allowance -= n
        if self._allowance < 0:
            self._sleep(-self._allowance / self.rate)


class Scrubber:
    """Runs scrub work on one store. Not thread-safe; one per thread.

    ``run`` verifies at most ``max_items`` entries (all, when None) of the current
    cycle, or until ``until_complete`` finishes the cycle; ``should_stop`` is polled
    between entries (the background thread's shutdown flag).
    """

    def __init__(self, store: Store, *, rate_bytes: int | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        self.store = store
        self.limiter = RateLimiter(rate_bytes, sleep=sleep)

    @property
    def lock_path(self) -> Path:
        return self.store.layout.state / SCRUB_LOCK

    @contextlib.contextmanager
    def _exclusive(self, wait: bool) -> Iterator[bool]:
        with try_hold(self.lock_path, exclusive=True) as held:
            if held or not wait:
                yield held
                return
        from .locks import hold

        with hold(self.lock_path, exclusive=True, timeout=self.store.lock_timeout,
                  what="scrubbing"):
            yield True

    def run(
        self,
        *,
        max_items: int | None = None,
        until_complete: bool = False,
        wait: bool = False,
        should_stop: Callable[[], bool] | None = None,
        progress: Callable[[Cycle, int], None] | None = None,
    ) -> ScrubReport | None:
        """Do scrub work; return None if another scrubber holds the lock and ``wait``
        is False (the caller skips this step), else what was done."""
        started = time.monotonic()
        with self._exclusive(wait) as held:
            if not held:
                return None
            state = ScrubState.open_checked(self.store)
            try:
                report = self._run(state, max_items, until_complete, should_stop, progress)
            finally:
                state.close()
        report.seconds = round(time.monotonic() - started, 6)
        return report

    def _run(self, state, max_items, until_complete, should_stop, progress) -> ScrubReport:
        store = self.store
        cycle = state.current()
        report = ScrubReport()
        if cycle is None:
            cycle = state.start_cycle(time.time(), store.totals().entries)
        else:
            report.resumed = True
        report.cycle_id = cycle.cycle_id
        budget = None if until_complete or max_items is None else max_items
        if cycle.inflight:
            # A previous run died while verifying this entry: finish it first, from disk.
            # Ids between the cursor and it were pending rows, so the walk goes on after it.
            self._one(state, cycle.cycle_id, cycle.inflight, report, next_cursor=cycle.inflight)
        cursor = cycle.inflight or cycle.cursor
        total = store.totals().entries
        while True:
            batch = store.run_with_catalog_repair(
                lambda c=cursor: store.catalog.iter_ids_after(c, BATCH))
            if not batch:
                self._finish(state, cycle, report)
                break
            stop = False
            for entry_id, row_state in batch:
                if (budget is not None and budget <= 0) or (should_stop and should_stop()):
                    stop = True
                    break
                if row_state == "committed":
                    state.save(cycle.cycle_id, cursor=cursor, inflight=entry_id)
                    self._one(state, cycle.cycle_id, entry_id, report, next_cursor=entry_id)
                    if budget is not None:
                        budget -= 1
                else:
                    # Pending rows are commits in flight (or interrupted, resolved by recovery).
                    state.save(cycle.cycle_id, cursor=entry_id, inflight=None)
                cursor = entry_id
                if progress is not None:
                    current = state.current()
                    if current is not None:
                        progress(current, total)
            if stop:
                break
        return report

    def _one(self, state: ScrubState, cycle_id: int, entry_id: str, report: ScrubReport, *,
             next_cursor: str) -> None:
        """Verify one entry, then record the outcome and clear ``inflight``."""
        try:
            outcome, nbytes, reason = self.verify_entry(entry_id)
        except StoreIOError as exc:  # e.g. quarantining failed: the directory is read-only
            log.warning("scrub: cannot verify %s: %s", entry_id[:16], exc)
            outcome, nbytes, reason = UNREADABLE, 0, exc.message
        counts = {"checked": 0, "quarantined": 0, "absent": 0, UNREADABLE: 0}
        counts[outcome] = 1
        if outcome == "quarantined":
            state.add_finding(cycle_id, entry_id, reason)
            report.quarantined.append({"entry_id": entry_id, "reason": reason})
        elif outcome == UNREADABLE:
            state.add_finding(cycle_id, entry_id, UNREADABLE)
            report.unreadable.append({"entry_id": entry_id, "detail": reason})
        elif outcome == "checked":
            report.checked += 1
            report.bytes += nbytes
        else:
            report.absent += 1
        state.save(cycle_id, cursor=next_cursor, inflight=None, checked=counts["checked"],
                   nbytes=nbytes, quarantined=counts["quarantined"], absent=counts["absent"])
        faults.checkpoint("scrub.progress_saved")

    def verify_entry(self, entry_id: str) -> tuple[str, int, str]:
        """Re-read and verify ``entry_id`` now, paced by the rate limit.

        Returns ``(outcome, bytes_read, reason)`` where outcome is ``checked``,
        ``quarantined`` (moved to quarantine now), ``absent`` (deleted meanwhile) or
        ``unreadable`` (an object could not be read: permissions or an I/O error; nothing
        is moved and ``reason`` says why). An object that is not a regular file (a FIFO,
        a symlink) is damage: quarantined.
        """
        store = self.store
        try:
            manifest = store.manifest(entry_id)  # quarantines a bad manifest itself
        except NotFoundError:
            return "absent", 0, ""
        except CorruptionError as exc:
            return "quarantined", 0, exc.reason.value
        path = store.layout.manifest_path(entry_id)
        nbytes = 0
        with contextlib.suppress(OSError):
            nbytes = path.stat().st_size
        for ref in manifest.objects:
            obj = store.layout.object_path(ref.digest)
            try:
                verify_object(obj, digest=ref.digest, size=ref.size, pace=self.limiter.consume)
            except (OSError, CorruptionError) as exc:
                failed = failed_object(store, entry_id, ref.name, ref.digest, obj, exc,
                                       found_by="scrub")
                if isinstance(failed.error, NotFoundError):
                    return "absent", nbytes, ""  # deleted by maintenance meanwhile
                if failed.failure.reason is None:
                    log.warning("scrub: cannot read %s: %s", obj, failed.failure.detail)
                    return UNREADABLE, nbytes, failed.failure.detail
                return "quarantined", nbytes + ref.size, failed.failure.reason.value
            nbytes += ref.size
        return "checked", nbytes, ""

    def _finish(self, state: ScrubState, cycle: Cycle, report: ScrubReport) -> None:
        """End of the walk: reclaim proven orphans and abandoned temp files, close the cycle."""
        store = self.store
        age = max(time.time() - cycle.started, 0.0)
        try:
            orphans = store.collect_orphans(min_age=max(age, MIN_ORPHAN_AGE))
            report.orphans = {
                "objects": orphans.orphan_objects.objects, "bytes": orphans.orphan_objects.bytes,
                "young": orphans.young_orphans, "indexed": orphans.indexed,
                "dropped_rows": orphans.dropped_rows, "quarantined": orphans.quarantined}
            tmp = store.clean_tmp(min_age=max(age, MIN_TMP_AGE))
            report.tmp = tmp.to_json()
        except BusyError:
            # Maintenance is busy (a clean is running): leave the cycle open at its end;
            # the next run finishes it.
            return
        state.finish(cycle.cycle_id, orphan_objects=orphans.orphan_objects.objects,
                     orphan_bytes=orphans.orphan_objects.bytes, tmp_files=tmp.files,
                     tmp_bytes=tmp.bytes)
        report.cycle_completed = True
