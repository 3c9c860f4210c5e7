"""Import an archive (or a peer's store root) into local stores: verify, then publish.

Each object is hashed as it streams into the target's ``tmp/`` and kept only if it matches
its digest and its manifest validates; verified entries are published through the store's
commit protocol, so an entry is visible complete or not at all. Objects and entries the
target holds are not written again.

Capacity: an archive that declares more than a store's max size (or the disk) is refused
up front; an entry that would take a store above its low watermark is skipped. Imports
never evict: on a live rank store only the connector may choose victims.

A defect in the archive (``ArchiveError``) stops the import at that member; entries verified
before it are published, nothing of the defective one is.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import ArchiveError, CapacityError, ConfigError
from ..disk.root import MARKER
from ..sealing import KeyTable, MasterKey, check_key_table
from ..store import Store
from .archive import ArchiveIndex, SectionCount, Stream, TarReader, parse_end_record, rank_of
from .ingest import PlaceTally, Section, SkipSection, free_bytes
from .places import RootContents, Target, check_single_layout, inspect_root
from .selection import resolve_deployments

# (source bytes consumed, entries done, planned total bytes or None)
Progress = Callable[[int, int, int | None], None]
FLUSH_THREADS = 8


@dataclass
class ImportReport:
    source: str
    target: str
    places: list[PlaceTally] = field(default_factory=list)
    source_bytes: int = 0
    seconds: float = 0.0
    complete: bool = False
    error: str | None = None

    def total(self, name: str) -> int:
        return sum(getattr(p, name) for p in self.places)

    def to_json(self) -> dict[str, Any]:
        keys = ("imported", "released", "present", "skipped_capacity", "skipped_vanished",
                "skipped_corrupt", "skipped_unauthenticated", "skipped_key", "filtered",
                "objects_written",
                "objects_present", "bytes_written")
        return {"source": self.source, "target": self.target, "complete": self.complete,
                "error": self.error, "source_bytes": self.source_bytes,
                "seconds": round(self.seconds, 4),
                "bytes_per_second": round(self.source_bytes / self.seconds)
                if self.seconds > 0 else None,
                **{k: self.total(k) for k in keys},
                "stores": [p.to_json() for p in self.places]}


class Importer:
    """Imports into the stores under ``target`` (a store, deployment dir or base root).

    ``accept``: deployments that may be imported into a base root serving others (and, when
    given, the only ones imported). ``rank``: import only that rank's stores.
    ``store_max_bytes``: recorded in stores the import creates. ``layout``: the target
    already classified. ``retag``: entries the target's tag key does not authenticate are
    tagged with it instead of skipped (the operator vouches for the source)."""

    def __init__(self, target: str | os.PathLike[str], *, accept: tuple[str, ...] = (),
                 store_max_bytes: int | None = None, progress: Progress | None = None,
                 wants: Callable[[Any], bool] | None = None, rank: int | None = None,
                 layout: RootContents | None = None, retag: bool = False):
        self.layout = layout if layout is not None else inspect_root(target)
        self.retag = retag
        self.rank = rank
        self.wants = wants
        self.accept_given = tuple(accept)
        self.store_max_bytes = store_max_bytes
        self.progress = progress
        self._stack = contextlib.ExitStack()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="spoolctl-import-hash")
        self._flusher = ThreadPoolExecutor(FLUSH_THREADS, thread_name_prefix="spoolctl-import-sync")
        self.sections: dict[str, Section] = {}
        self.report = ImportReport(source="", target=str(self.layout.path))
        self._entries_done = 0
        self.planned_bytes: int | None = None

    # -- planning (before anything is written) -------------------------------------------

    def prepare(self, declared: dict[str, int], *, strict: bool,
                wants: Callable[[Any], bool] | None = None,
                released: Mapping[str, frozenset[str]] | None = None,
                keys: Mapping[str, KeyTable] | None = None) -> None:
        """Route every source store, check capacity, open (or create) the targets.
        ``released``: per source store, the entries it holds released (kept released).
        ``keys``: per source store, the wrapped data keys of its encrypted entries: checked
        against this host's master key before any store is opened or created, then merged
        into each target's keyring."""
        places = list(declared)
        check_single_layout(places)
        if self.rank is not None and "" in places:
            raise ConfigError("--rank selects rank stores; this source is a single store",
                              fix="drop --rank")
        if self.rank is not None and places and \
                all(rank_of(p) != self.rank for p in places):
            have = sorted({r for p in places if (r := rank_of(p)) is not None})
            raise ConfigError(f"the source has no store for rank {self.rank}",
                              fix="ranks there: " + ", ".join(str(r) for r in have[:20]))
        deployments = {p.split("/", 1)[0] for p in places if p}
        accept = resolve_deployments(self.accept_given, deployments) \
            if self.accept_given else set()
        target = Target(self.layout, frozenset(accept))
        routes: dict[str, Path | None] = {}
        for place in places:
            dep = place.split("/", 1)[0] if place else None
            skip = (accept and dep not in accept) or \
                (self.rank is not None and rank_of(place) != self.rank)
            routes[place] = None if skip else target.route(place)
        self.planned_bytes = sum(declared.values())
        tables = {p: t for p, t in (keys or {}).items() if routes.get(p) is not None and t.keys}
        if tables:
            master = MasterKey.from_environment()
            for table in tables.values():
                check_key_table(master, table, self.report.source)
        per_dest: dict[Path, int] = {}
        for place, dest in routes.items():
            if dest is not None:
                per_dest[dest] = per_dest.get(dest, 0) + declared[place]
        existing_bytes = 0
        for dest, need in per_dest.items():
            max_bytes = self.store_max_bytes
            if (dest / MARKER).exists():
                with Store.open(dest) as st:
                    max_bytes = st.max_bytes
                    existing_bytes += st.totals().bytes
            if max_bytes is not None and need > max_bytes:
                raise CapacityError(
                    f"the archive holds {need} bytes for this store, more than its max size "
                    f"({max_bytes})", path=dest,
                    fix="export less (--max-size) or raise the store's max size")
        total = sum(per_dest.values())
        free = free_bytes(self.layout.path)
        if total > free + existing_bytes:
            raise CapacityError(f"the archive holds {total} bytes, the disk has {free} free",
                                path=self.layout.path,
                                fix="export less (--max-size) or free disk space")
        for place, dest in routes.items():
            tally = PlaceTally(place=place, root=str(dest) if dest else "")
            self.report.places.append(tally)
            if dest is None:
                self.sections[place] = SkipSection(tally)
                continue
            tally.created = not (dest / MARKER).exists()
            store = self._stack.enter_context(
                Store.open(dest, create=True, max_bytes=self.store_max_bytes
                           if tally.created else None))
            if self.retag and store.tag_key is None:
                raise ConfigError("--retag needs a tag key to tag with", path=dest,
                                  fix="set SPOOLCTL_TAG_KEY_FILE (see docs/SECURITY.md)")
            if place in tables:
                if store.sealer is None:  # the key source changed since it was checked
                    raise ConfigError("the master key went away during the import", path=dest,
                                      fix="check SPOOLCTL_MASTER_KEY_FILE and import again")
                adopted = store.sealer.keyring.adopt(tables[place], self.report.source)
                tally.keys_added, tally.keys_refused = len(adopted.added), len(adopted.refused)
            self.sections[place] = Section(store, tally, self._pool, self._flusher,
                                           strict=strict, wants=wants, retag=self.retag)
            self.sections[place].released = (released or {}).get(place, frozenset())

    def section(self, place: str) -> Section:
        sec = self.sections.get(place)
        if sec is None:
            raise ArchiveError(f"member of store {place or '(single store)'} that the archive "
                               "index does not list", fix="the archive was not written by "
                               "`spoolctl export`; do not import it")
        return sec

    def entry_done(self, source_bytes: int) -> None:
        self._entries_done += 1
        self.report.source_bytes = source_bytes
        if self.progress is not None:
            self.progress(source_bytes, self._entries_done, self.planned_bytes)

    # -- running ---------------------------------------------------------------------------

    def run(self, body: Callable[[], None], source: str) -> ImportReport:
        """Run ``body`` (which feeds the sections); publish what was verified, also when it
        stops at an ArchiveError (re-raised with ``report`` attached)."""
        self.report.source = source
        started = time.perf_counter()
        try:
            body()
            for sec in self.sections.values():
                sec.finish()
            self.report.complete = True
        except ArchiveError as exc:
            for sec in self.sections.values():
                sec._discard_entry(dropped=False)
                with contextlib.suppress(ArchiveError):
                    sec.flush()
            self.report.error = str(exc)
            exc.report = self.report
            raise
        except BaseException:
            for sec in self.sections.values():
                sec.abandon()
            raise
        finally:
            self.report.seconds = time.perf_counter() - started
            self._stack.close()
            self._pool.shutdown(wait=True)
            self._flusher.shutdown(wait=True)
        return self.report

    def from_archive(self, stream: Stream, name: str = "-") -> ImportReport:
        """Import the archive read from ``stream`` (a file or a pipe)."""
        reader = TarReader(stream)

        def body() -> None:
            first = reader.next()
            if first is None or first.area != "index":
                raise ArchiveError("not a spoolctl archive (it does not start with "
                                   "spoolctl-archive.json)", fix="pass a file written by "
                                   "`spoolctl export`")
            index = ArchiveIndex.from_bytes(reader.read_all())
            self.prepare({s.place: s.bytes for s in index.stores}, strict=True,
                         wants=self.wants, released={s.place: s.released for s in index.stores},
                         keys={s.place: s.keys for s in index.stores if s.keys is not None})
            self._read_members(reader, index)

        return self.run(body, name)

    def _read_members(self, reader: TarReader, index: ArchiveIndex) -> None:
        counts = {s.place: SectionCount(s.place) for s in index.stores}
        end: dict[str, SectionCount] | None = None
        while (member := reader.next()) is not None:
            if end is not None:
                raise ArchiveError(f"member {member.name[:120]!r} after the end record",
                                   fix="the archive is damaged or hostile")
            if member.area == "index":
                raise ArchiveError("duplicated archive index", fix="the archive is hostile")
            if member.area == "end":
                end = parse_end_record(reader.read_all())
                continue
            sec = self.section(member.place)
            planned = index.section(member.place)
            count = counts[member.place]
            count.bytes += member.size
            if planned is None or count.bytes > planned.bytes:
                raise ArchiveError(f"store {member.place or '(single store)'} holds more bytes "
                                   "than the archive index declares", fix="the archive is "
                                   "damaged or hostile; do not import it")
            if member.area == "object":
                count.objects += 1
                sec.on_object(member.hexid, member.size, reader)
            else:
                count.entries += 1
                if count.entries > planned.entries:
                    raise ArchiveError(f"store {member.place or '(single store)'} holds more "
                                       "entries than the archive index declares",
                                       fix="the archive is damaged or hostile")
                sec.on_manifest(member.hexid, reader.read_all())
                self.entry_done(reader.offset)
        self.report.source_bytes = reader.offset
        if end is None:
            raise ArchiveError(f"archive truncated after {sum(c.entries for c in counts.values())}"
                               f" entries ({reader.offset} bytes): it has no end record",
                               fix="the transfer was cut short; the complete entries were "
                                   "imported, run the import again for the rest")
        for place, count in counts.items():
            got = end.get(place, SectionCount(place))
            if (got.entries, got.objects, got.bytes) != (count.entries, count.objects,
                                                         count.bytes):
                raise ArchiveError(f"archive end record disagrees with its contents for store "
                                   f"{place or '(single store)'}", fix="the archive is "
                                   "damaged or hostile; do not trust it")
        if set(end) - set(counts):
            raise ArchiveError("archive end record names a store the index does not list",
                               fix="the archive is damaged or hostile")

