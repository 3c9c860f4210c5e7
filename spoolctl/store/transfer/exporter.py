"""Export selected entries of the stores under a root as one streaming archive.

The archive is written front to back without seeking; memory is bounded by the read-ahead
(``READ_AHEAD_BYTES``; an entry over ``ENTRY_BUFFER`` is streamed). Every object is verified
as it is read: a corrupt entry is quarantined and left out, as is one deleted meanwhile. A
streamed object that fails only at its end cannot be taken back: the export stops with a
CorruptionError and no end record, which every import refuses as truncated.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from spoolctl import __version__

from ...errors import CorruptionError, NotFoundError, SpoolError
from ..disk import faults
from ..disk.verify import failed_object, verify_object
from ..format.manifest import Manifest, ObjectRef, encode
from ..sealing import KeyTable, read_key_table, sealed_fact
from ..store import Store
from .archive import (
    END_NAME,
    INDEX_NAME,
    ArchiveIndex,
    SectionCount,
    StoreSection,
    TarWriter,
    end_record,
    manifest_member,
    object_member,
)
from .places import RootContents, find_stores
from .selection import Candidate, Selection, plan, resolve_deployments

# An entry whose new objects fit this is read (and verified) whole before any of it is
# written, so a corrupt entry is simply left out; larger objects are streamed.
ENTRY_BUFFER = 64 << 20
# Entries read and verified ahead of the writer (by READERS threads), bounded in bytes.
READERS = 4
READ_AHEAD = 16
READ_AHEAD_BYTES = 128 << 20

# Per planned entry beyond its bytes: a header and up to a block of padding for its manifest
# and for each of its objects (at most a few per entry; a large entry's slack is noise).
TAR_BLOCK = 512
_MEMBER_SLACK = 4 * 2 * TAR_BLOCK
_END_SLACK = 64 * TAR_BLOCK  # the end record and the end-of-archive record padding

# (archive bytes written, entries written, planned total bytes or None)
Progress = Callable[[int, int, int | None], None]


@dataclass
class ExportReport:
    """What an export wrote and what it left out."""

    root: str
    stores: list[SectionCount] = field(default_factory=list)
    archive_bytes: int = 0
    seconds: float = 0.0
    gone: int = 0
    corrupt: int = 0
    over_budget: int = 0
    incomplete_chunks: int = 0
    filtered: int = 0
    key_erased: int = 0  # encrypted entries whose data key the store no longer holds
    # store place -> the one-line error it could not be opened with (several stores only)
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def entries(self) -> int:
        return sum(s.entries for s in self.stores)

    @property
    def objects(self) -> int:
        return sum(s.objects for s in self.stores)

    @property
    def payload_bytes(self) -> int:
        return sum(s.bytes for s in self.stores)

    def to_json(self) -> dict[str, Any]:
        return {"root": self.root, "entries": self.entries, "objects": self.objects,
                "bytes": self.payload_bytes, "archive_bytes": self.archive_bytes,
                "seconds": round(self.seconds, 4),
                "bytes_per_second": round(self.archive_bytes / self.seconds)
                if self.seconds > 0 else None,
                "stores": [s.to_json() for s in self.stores],
                "failed": dict(self.failed),
                "left_out": {"deleted_meanwhile": self.gone, "corrupt": self.corrupt,
                             "over_budget": self.over_budget,
                             "incomplete_chunks": self.incomplete_chunks,
                             "filtered": self.filtered, "key_erased": self.key_erased}}


def _summary(store: Store, row_id: str | None) -> dict[str, Any] | None:
    """The deployment summary a vLLM chunk's manifest records (for import's messages)."""
    if row_id is None:
        return None
    with contextlib.suppress(NotFoundError, CorruptionError):
        dep = store.manifest(row_id).meta.get("deployment")
        return dict(dep) if isinstance(dep, dict) else None
    return None


def export(root: str | os.PathLike[str], sink: Callable[[list[Any]], None],
           selection: Selection | None = None, *, progress: Progress | None = None,
           layout: RootContents | None = None, quorum: bool | None = None) -> ExportReport:
    """Write the entries of the stores under ``root`` chosen by ``selection`` to ``sink``.

    ``layout``: ``root`` already classified (``RootContents.archivable``; may hold no
    store). ``quorum``: False exports one rank of a deployment. With several stores, one
    that cannot be opened is recorded in ``failed`` and the others are exported. Raises
    ConfigError for a bad root, selection or a store no archive carries, CorruptionError if
    a streamed object fails verification (the archive then has no end record).
    """
    selection = selection or Selection()
    started = time.perf_counter()
    layout = layout if layout is not None else find_stores(root)
    quorum = layout.quorum if quorum is None else quorum
    stores = list(layout.stores)
    if selection.deployments:
        wanted = resolve_deployments(selection.deployments, layout.deployments)
        stores = [s for s in stores
                  if s.archive_place.split("/", 1)[0] in wanted and s.archive_place]
    report = ExportReport(root=str(layout.path))
    with contextlib.ExitStack() as stack:
        opened: dict[str, Store] = {}
        for s in stores:
            place = s.archive_place  # before the open: a store no archive carries is refused
            try:
                opened[place] = stack.enter_context(Store.open(s.path))
            except SpoolError as exc:
                if len(stores) == 1:
                    raise
                report.failed[place] = str(exc)
        rows = {place: st.entries(sort="access", include_pending=False)
                for place, st in opened.items()}
        tables: dict[str, KeyTable] = {}
        for place, st in opened.items():
            rows[place], table = _with_keys(st, rows[place], report)
            if table is not None:
                tables[place] = table
        manifest_sizes = {(place, r.entry_id): r.manifest_size
                          for place, rs in rows.items() for r in rs}
        candidates = {place: [Candidate(place, r.entry_id, r.kind, r.namespace, r.key, r.size,
                                        r.last_access, r.hint) for r in rs]
                      for place, rs in rows.items()}
        for place in report.failed:  # a rank that failed still counts for the quorum
            candidates[place] = []
        chosen = plan(candidates, selection, quorum=quorum)
        report.over_budget = chosen.over_budget
        report.incomplete_chunks = chosen.incomplete_chunks
        report.filtered = chosen.filtered
        per_place = chosen.by_place()
        sections = []
        for place, st in opened.items():
            parts = per_place.get(place, [])
            kinds: dict[str, int] = {}
            for c in parts:
                kinds[c.kind] = kinds.get(c.kind, 0) + 1
            first_vllm = next((c.entry_id for c in parts if c.kind == "vllm"), None)
            sections.append(StoreSection(
                place=place, entries=len(parts), bytes=sum(c.size for c in parts),
                store_id=st.marker.store_id, kinds=kinds, deployment=_summary(st, first_vllm),
                released=frozenset(c.entry_id for c in parts if c.hint == "release"),
                keys=_needed(tables.get(place), rows[place], {c.entry_id for c in parts})))
        index = ArchiveIndex(stores=tuple(sections), created=time.time(),
                             tool=f"spoolctl {__version__}")
        writer = TarWriter(sink)
        writer.add(INDEX_NAME, index.to_bytes(), index.created)
        counts = {place: SectionCount(place) for place in opened}
        emitted: dict[str, set[str]] = {place: set() for place in opened}
        pool = stack.enter_context(ThreadPoolExecutor(READERS,
                                                      thread_name_prefix="spoolctl-export"))
        # What the archive will hold at most: every planned member with its header and
        # padding (shared objects are written once, so the archive may come out smaller).
        # Progress never shows more written than planned.
        planned = writer.offset + _END_SLACK + sum(
            c.size + manifest_sizes.get((c.place, c.entry_id), 0) + _MEMBER_SLACK
            for c in chosen.parts)
        written = 0
        for c, loaded in _read_ahead(opened, chosen.parts, pool):
            _emit_entry(opened[c.place], c, loaded, writer, counts[c.place], emitted[c.place],
                        report)
            if loaded.status == "ok":
                written += 1
            if progress is not None:
                progress(writer.offset, written, max(planned, writer.offset))
            faults.checkpoint("export.entry_written")
        writer.add(END_NAME, end_record(counts.values()), time.time())
        writer.close()
        report.stores = list(counts.values())
    report.archive_bytes = writer.offset
    report.seconds = time.perf_counter() - started
    if progress is not None:
        progress(writer.offset, report.entries, writer.offset)
    return report


def _with_keys(store: Store, rows: list[Any], report: ExportReport
               ) -> tuple[list[Any], KeyTable | None]:
    """``rows`` without the encrypted entries whose data key the keyring no longer holds
    (crypto-erased), and the wrapped keys of the others as the keyring holds them (the
    exporter needs no master key)."""
    facts = {r.entry_id: f for r in rows if (f := sealed_fact(r.index)) is not None}
    if not facts:
        return rows, None
    table = read_key_table(store.layout.state, set(facts.values()))
    have = {(t, v) for t, v, _ in table.keys} if table is not None else set()
    kept = [r for r in rows if r.entry_id not in facts or facts[r.entry_id] in have]
    report.key_erased += len(rows) - len(kept)
    return kept, table


def _needed(table: KeyTable | None, rows: list[Any], chosen: set[str]) -> KeyTable | None:
    """The keys of ``table`` that the ``chosen`` entries are sealed under (none: None)."""
    if table is None:
        return None
    used = {f for r in rows if r.entry_id in chosen and (f := sealed_fact(r.index)) is not None}
    keys = tuple(k for k in table.keys if (k[0], k[1]) in used)
    return KeyTable(table.master_id, keys) if keys else None


@dataclass
class _Loaded:
    """One entry read ahead by a worker: ``status`` ok, gone or corrupt; ``payloads`` holds
    its objects verified in memory unless the entry is ``large`` (streamed instead)."""

    status: str
    manifest: Manifest | None = None
    data: bytes = b""
    payloads: dict[str, memoryview] = field(default_factory=dict)
    large: bool = False


def _load(store: Store, c: Candidate) -> _Loaded:
    try:
        manifest = store.manifest(c.entry_id)
        unique = {ref.digest: ref for ref in manifest.objects}
        # An encrypted entry travels as its ciphertext, streamed and checked against its
        # keyless digest like a large one: the exporter needs no key.
        if sealed_fact(manifest.index) is not None or \
                sum(r.size for r in unique.values()) > ENTRY_BUFFER:
            return _Loaded("ok", manifest, encode(manifest), large=True)
        payloads = {d: store.read(manifest, ref.name) for d, ref in unique.items()}
    except NotFoundError:
        return _Loaded("gone")
    except CorruptionError:
        return _Loaded("corrupt")  # the store quarantined it
    return _Loaded("ok", manifest, encode(manifest), payloads)


def _read_ahead(opened: dict[str, Store], parts: list[Candidate],
                pool: ThreadPoolExecutor) -> Iterator[tuple[Candidate, _Loaded]]:
    """``_load`` every part on ``pool``, yielded in order, with a bounded read-ahead (the
    next entry is read and verified while this one is written)."""
    window: deque[tuple[Candidate, Future[_Loaded]]] = deque()
    ahead_bytes = 0
    it = iter(parts)
    exhausted = False
    while True:
        while not exhausted and (not window or (len(window) < READ_AHEAD and
                                                ahead_bytes < READ_AHEAD_BYTES)):
            c = next(it, None)
            if c is None:
                exhausted = True
                break
            window.append((c, pool.submit(_load, opened[c.place], c)))
            ahead_bytes += min(c.size, ENTRY_BUFFER)
        if not window:
            return
        c, fut = window.popleft()
        ahead_bytes -= min(c.size, ENTRY_BUFFER)
        yield c, fut.result()


def _emit_entry(store: Store, c: Candidate, loaded: _Loaded, writer: TarWriter,
                count: SectionCount, emitted: set[str], report: ExportReport) -> None:
    """Write one entry: its objects not yet in this store's section, then its manifest."""
    if loaded.status != "ok" or loaded.manifest is None:
        if loaded.status == "gone":
            report.gone += 1
        else:
            report.corrupt += 1
        return
    manifest = loaded.manifest
    new: dict[str, ObjectRef] = {}
    for ref in manifest.objects:
        if ref.digest not in emitted and ref.digest not in new:
            new[ref.digest] = ref
    for ref in new.values():
        if loaded.large:
            _stream_object(store, manifest, ref, writer, c.place)
        else:
            writer.add(object_member(c.place, ref.digest), loaded.payloads[ref.digest],
                       manifest.created)
        emitted.add(ref.digest)
        count.objects += 1
        count.bytes += ref.size
    writer.add(manifest_member(c.place, manifest.entry_id), loaded.data, manifest.created)
    count.entries += 1
    count.bytes += len(loaded.data)


def _stream_object(store: Store, manifest: Manifest, ref: ObjectRef, writer: TarWriter,
                   place: str) -> None:
    """Copy a large object into the archive, verifying it on the way. Damage quarantines
    the entry and stops the export (bytes may already be in the archive): CorruptionError;
    an unreadable object stops it too: StoreIOError."""
    path = store.layout.object_path(ref.digest)
    member = object_member(place, ref.digest)
    started, written = False, 0

    def each(chunk: memoryview) -> None:
        nonlocal started, written
        if not started:  # only once the object opened with the right size
            writer.begin(member, ref.size, manifest.created)
            started = True
        writer.write(chunk)
        written += len(chunk)

    try:
        verify_object(path, digest=ref.digest, size=ref.size, each=each)
    except (OSError, CorruptionError) as exc:
        error = failed_object(store, manifest.entry_id, ref.name, ref.digest, path, exc,
                              found_by="export").error
        if started:
            if written == ref.size:  # a whole member whose digest an import refuses
                writer.finish(ref.size)
            error.message += "; the archive is incomplete"
        error.fix = "run the export again" if isinstance(error, NotFoundError) else \
            f"{error.fix}; run the export again"
        raise error from exc
    if not started:  # an empty object: no chunk
        writer.begin(member, ref.size, manifest.created)
    writer.finish(ref.size)
