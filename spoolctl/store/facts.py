"""One snapshot of a store's facts: what ``spoolctl status``, ``spoolctl metrics`` and the
vLLM connector's gauges all read, so each fact is computed in one place.

``collect`` reads, once each: the catalog totals and per-kind counts (O(1) / one grouped
query), the released backlog, the malformed catalog rows (one scan), the quarantine
directory, ``tmp/``, the owner lease, the scrub progress database and the filesystem's
free bytes and inodes. It never changes
the store, and works on a store opened read-only. The snapshot is plain data; readers
render it (``to_json`` is the ``status --json`` shape of these facts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .catalog.index import Totals
from .disk.locks import OwnerInfo
from .disk.space import Space, space_of
from .maintain.gc import tmp_usage
from .maintain.scrub_state import ScrubState, ScrubSummary

if TYPE_CHECKING:
    from .disk.root import Marker, StorePaths
    from .maintain.quarantine import Quarantine, QuarantineItem


@dataclass(frozen=True)
class QuarantineFacts:
    """Quarantined items: how many, their bytes, and how many per reason value."""

    items: int = 0
    bytes: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"items": self.items, "bytes": self.bytes, "by_reason": dict(self.by_reason)}


@dataclass(frozen=True)
class StoreFacts:
    """A point-in-time snapshot of one store (see the module docstring)."""

    root: str
    store_id: str
    taken: float
    totals: Totals
    max_bytes: int | None
    by_kind: dict[str, dict[str, int]]
    released_entries: int
    released_bytes: int
    quarantine: QuarantineFacts
    tmp_files: int
    tmp_bytes: int
    tmp_complete: bool  # False: the count stopped at gc.TMP_COUNT_LIMIT (there are more)
    owner: OwnerInfo | None
    scrub: ScrubSummary
    unknown_files: tuple[str, ...] = ()
    malformed_rows: int = 0
    read_only: bool = False
    space: Space | None = None  # the filesystem's free bytes and inodes

    @property
    def usage_ratio(self) -> float | None:
        """bytes / max_bytes, or None for an unbounded store."""
        return self.totals.bytes / self.max_bytes if self.max_bytes else None

    @property
    def over_max(self) -> bool:
        return self.max_bytes is not None and self.totals.bytes > self.max_bytes

    @property
    def last_scrub_quarantined(self) -> int:
        last = self.scrub.last_cycle
        return last.quarantined if last else 0

    @property
    def scrub_unreadable(self) -> int:
        """Entries the last (or the current) scrub cycle could not read."""
        last, cur = self.scrub.last_cycle, self.scrub.current_cycle
        return max(last.unreadable if last else 0, cur.unreadable if cur else 0)

    @property
    def needs_attention(self) -> bool:
        """What ``status --check`` flags: quarantine, over max size, scrub findings
        (quarantined or unreadable entries), malformed catalog rows, a tmp/ too full to
        count."""
        return bool(self.quarantine.items or self.over_max or self.last_scrub_quarantined
                    or self.scrub_unreadable or self.malformed_rows or not self.tmp_complete)

    def to_json(self) -> dict[str, Any]:
        last = self.scrub.last_cycle
        ratio = self.usage_ratio
        return {
            "root": self.root,
            "store_id": self.store_id,
            "entries": self.totals.entries,
            "objects": self.totals.objects,
            "bytes": self.totals.bytes,
            "max_bytes": self.max_bytes,
            "usage_pct": round(100.0 * ratio, 2) if ratio is not None else None,
            "by_kind": self.by_kind,
            "released": {"entries": self.released_entries, "bytes": self.released_bytes},
            "quarantined": self.quarantine.to_json(),
            "tmp": {"files": self.tmp_files, "bytes": self.tmp_bytes,
                    "at_least": not self.tmp_complete},
            "orphans": {"reclaimed_by_last_scrub": {
                "objects": last.orphan_objects if last else 0,
                "bytes": last.orphan_bytes if last else 0}},
            "scrub": self.scrub.to_json(self.totals.entries),
            "owner": self.owner.to_json() if self.owner else None,
            "unknown_files": list(self.unknown_files),
            "malformed_rows": self.malformed_rows,
            "scrub_unreadable": self.scrub_unreadable,
            "read_only": self.read_only,
            "filesystem": self.space.to_json() if self.space is not None else None,
        }


class FactSource(Protocol):
    """What ``collect`` reads of a store (``Store`` is one): named here so that this module,
    below the ``Store`` facade, does not import it."""

    layout: StorePaths
    quarantine: Quarantine
    read_only: bool
    unknown_files: list[str]

    @property
    def marker(self) -> Marker: ...
    @property
    def root(self) -> Path: ...
    @property
    def max_bytes(self) -> int | None: ...
    def totals(self) -> Totals: ...
    def released(self) -> tuple[int, int]: ...
    def by_kind(self) -> dict[str, dict[str, int]]: ...
    def malformed_count(self) -> int: ...
    def quarantine_items(self) -> list[QuarantineItem]: ...
    def owner(self) -> OwnerInfo | None: ...


def collect(store: FactSource) -> StoreFacts:
    """Read every fact of ``store`` once (see the module docstring)."""
    totals = store.totals()
    released_n, released_b = store.released()
    items = store.quarantine_items()
    by_reason: dict[str, int] = {}
    for item in items:
        by_reason[item.reason] = by_reason.get(item.reason, 0) + 1
    tmp_files, tmp_bytes, tmp_complete = tmp_usage(store.layout.tmp)
    return StoreFacts(
        root=str(store.root),
        store_id=store.marker.store_id,
        taken=time.time(),
        totals=totals,
        max_bytes=store.max_bytes,
        by_kind=store.by_kind(),
        released_entries=released_n,
        released_bytes=released_b,
        quarantine=QuarantineFacts(len(items), sum(i.bytes for i in items), by_reason),
        tmp_files=tmp_files,
        tmp_bytes=tmp_bytes,
        tmp_complete=tmp_complete,
        owner=store.owner(),
        scrub=ScrubState.summary_of(store),
        unknown_files=tuple(store.unknown_files),
        malformed_rows=store.malformed_count(),
        read_only=store.read_only,
        space=space_of(store.root),
    )
