"""The cleaning pass (``spoolctl clean``, the cron job) as data: which steps run, in which
order, and what each deleted or would delete.

Steps, always in this order: ``released`` (delete released entries), ``capacity`` (evict
down to the low watermark), ``tmp`` (abandoned temp files), ``orphans`` (reconcile catalog
and disk). One bad part never stops the pass: malformed rows, undeletable files and failed
steps are reported (``malformed``, ``failed``, ``errors``) and the later steps still run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...errors import ConfigError, SpoolError
from .gc import DeleteReport
from .recovery import ReconcileReport

CLEAN_STEPS: tuple[str, ...] = ("released", "capacity", "tmp", "orphans")
_TOTALS = ("entries", "objects", "files", "bytes")


@dataclass
class CleanReport:
    """What one cleaning pass did (or, with ``dry_run``, would do), step by step."""

    dry_run: bool
    deleted: dict[str, DeleteReport] = field(default_factory=dict)
    orphans: ReconcileReport | None = None
    malformed: list[tuple[str, str]] = field(default_factory=list)  # (entry id, reason)
    malformed_count: int = 0
    errors: dict[str, str] = field(default_factory=dict)  # step -> one-line error

    @property
    def quarantined(self) -> int:
        """Manifests found invalid (and quarantined) while reconciling."""
        return self.orphans.quarantined if self.orphans is not None else 0

    def steps_json(self) -> dict[str, dict[str, Any]]:
        """Per step, in the order run: entries/objects/files/bytes (orphans: and what
        reconciling found)."""
        out: dict[str, dict[str, Any]] = {}
        for step in CLEAN_STEPS:
            if step in self.deleted:
                out[step] = self.deleted[step].to_json()
            elif step == "orphans" and self.orphans is not None:
                rep = self.orphans
                out[step] = {**rep.orphan_objects.to_json(), "indexed": rep.indexed,
                             "dropped_rows": rep.dropped_rows, "quarantined": rep.quarantined,
                             "young_orphans": rep.young_orphans,
                             "repaired_rows": rep.repaired_rows}
                if rep.unreadable:
                    out[step]["unreadable"] = dict(list(rep.unreadable.items())[:20])
        return out

    @property
    def failed(self) -> int:
        """Files that could not be deleted, over every step."""
        return sum(len(r.failed) for r in self.deleted.values()) + (
            len(self.orphans.orphan_objects.failed) + len(self.orphans.unreadable)
            if self.orphans is not None else 0)

    def to_json(self) -> dict[str, Any]:
        steps = self.steps_json()
        total = {k: sum(int(step.get(k, 0)) for step in steps.values()) for k in _TOTALS}
        return {"dry_run": self.dry_run, "steps": steps, "total": total,
                "malformed_rows": {"count": self.malformed_count,
                                   "rows": [{"entry_id": e, "reason": r}
                                            for e, r in self.malformed]},
                "failed": self.failed, "errors": dict(self.errors)}


class Cleanable(Protocol):
    """The store operations a cleaning pass runs (``Store`` has them; this module sits
    below the facade and must not import it)."""

    def malformed_count(self) -> int: ...
    def malformed_rows(self, limit: int = 100) -> list[tuple[str, str]]: ...
    def clean_released(self, *, dry_run: bool = False,
                       also: Iterable[str] = ()) -> DeleteReport: ...
    def enforce_capacity(self, *, dry_run: bool = False, budget: int | None = None,
                         wait: bool = True, before: Iterable[str] = ()) -> DeleteReport: ...
    def clean_tmp(self, *, min_age: float = ..., dry_run: bool = False) -> DeleteReport: ...
    def collect_orphans(self, *, min_age: float = ...,
                        dry_run: bool = False) -> ReconcileReport: ...


def run_clean(store: Cleanable, steps: Iterable[str] = CLEAN_STEPS, *, min_age: float,
              dry_run: bool, also_released: Iterable[str] = ()) -> CleanReport:
    """Run ``steps`` (any of ``CLEAN_STEPS``, in their fixed order) on ``store``.

    ``min_age``: seconds temp files and orphan objects must be old. ``dry_run``: report
    exactly what the run would do (``capacity`` planned from what ``released`` leaves;
    ``also_released`` counted as released). ConfigError for an unknown step.
    """
    wanted = set(steps)
    unknown = wanted - set(CLEAN_STEPS)
    if unknown:
        raise ConfigError(f"unknown clean step(s): {', '.join(sorted(unknown))}",
                          fix=f"use {', '.join(CLEAN_STEPS)}")
    report = CleanReport(dry_run=dry_run)
    try:
        report.malformed_count = store.malformed_count()
        report.malformed = store.malformed_rows(20) if report.malformed_count else []
    except SpoolError as exc:
        report.errors["rows"] = str(exc)
    also = list(also_released) if dry_run else []

    def released_first() -> list[str]:  # what a dry run's released step deletes
        done = report.deleted.get("released")
        return done.entry_ids if dry_run and done is not None else []

    deletes: dict[str, Callable[[], DeleteReport]] = {
        "released": lambda: store.clean_released(dry_run=dry_run, also=also),
        "capacity": lambda: store.enforce_capacity(dry_run=dry_run, before=released_first()),
        "tmp": lambda: store.clean_tmp(min_age=min_age, dry_run=dry_run),
    }
    for step in CLEAN_STEPS:
        if step not in wanted:
            continue
        try:
            if step == "orphans":
                report.orphans = store.collect_orphans(min_age=min_age, dry_run=dry_run)
            else:
                report.deleted[step] = deletes[step]()
        except SpoolError as exc:  # recorded; the later steps still run
            report.errors[step] = str(exc)
    return report
