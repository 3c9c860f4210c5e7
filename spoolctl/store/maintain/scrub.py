"""Deep scrub: re-read and verify every manifest and object at a bounded byte rate.

A *cycle* walks every catalog entry in id order; progress (cursor, ``inflight`` entry)
is saved in ``state/scrub.sqlite3`` before each entry, so a killed scrub resumes and
re-verifies the entry it was in. A failed entry is quarantined before the cursor passes
it; an object that cannot be read is an ``unreadable`` finding (nothing moved). At the
end the cycle reclaims proven orphans and abandoned temp files. One scrubber per store
at a time (``state/scrub.lock``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import BusyError, CorruptionError, NotFoundError, StoreIOError
from ..disk import faults
from ..disk.locks import try_hold
from ..disk.verify import failed_object, verify_object
from .scrub_state import (  # noqa: F401 (the progress database's names, imported from here too)
    SCRUB_DB,
    UNREADABLE,
    Cycle,
    ScrubState,
    ScrubSummary,
)

if TYPE_CHECKING:
    from ..store import Store

log = logging.getLogger("spoolctl.store")

SCRUB_LOCK = "scrub.lock"
BATCH = 256
CHUNK = 1 << 20
# Temp files are only reclaimed this old (or when their writer is dead), whatever the
# cycle length: a live writer may take long to write a large object.
MIN_TMP_AGE = 3600.0
# Orphans must also be at least this old: filesystem timestamps are coarse (jiffies), so
# "older than the cycle start" alone could catch an object written just after it.
MIN_ORPHAN_AGE = 60.0


@dataclass
class ScrubReport:
    """What one scrub run did."""

    cycle_id: int = 0
    checked: int = 0
    bytes: int = 0
    absent: int = 0
    quarantined: list[dict[str, str]] = field(default_factory=list)
    unreadable: list[dict[str, str]] = field(default_factory=list)
    cycle_completed: bool = False
    resumed: bool = False
    orphans: dict[str, int] = field(default_factory=dict)
    tmp: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
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
    """Runs scrub work on one store. Not thread-safe; one per thread."""

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
        from ..disk.locks import hold

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
        """Verify at most ``max_items`` entries of the current cycle (all when None), or
        until the cycle finishes (``until_complete``); ``should_stop`` is polled between
        entries. Returns what was done, or None if another scrubber holds the lock and
        ``wait`` is False."""
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

    def _run(self, state: ScrubState, max_items: int | None, until_complete: bool,
             should_stop: Callable[[], bool] | None,
             progress: Callable[[Cycle, int], None] | None) -> ScrubReport:
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
            def page(c: str = cursor) -> list[tuple[str, str]]:
                return store.catalog.iter_ids_after(c, BATCH)

            batch = store.run_with_catalog_repair(page)
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

        Returns ``(outcome, bytes_read, reason)``; outcome is ``checked``, ``quarantined``
        (moved now; a special file counts as damage), ``absent`` (deleted meanwhile) or
        ``unreadable`` (nothing moved; ``reason`` says why).
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
