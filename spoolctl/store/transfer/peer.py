"""Import straight from another store root (a peer's disk mounted here, a shared filesystem).

The peer is only read: its manifests and objects are opened with ``O_NOFOLLOW`` and read;
its locks and temp files are never touched, nor its catalog but for reading hints
(``Store.open`` would recover and clean them, which is the owner's job and unsafe across
hosts). Hints come from an immutable snapshot of the catalog (released stays released;
an unreadable catalog counts every entry retained). An entry deleted or corrupt while it is
copied is skipped; the same verification and commit path as an archive import applies.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import sqlite3
from pathlib import Path

from ...errors import ManifestError, QuarantineReason, SpoolError
from ..catalog.schema import DDL as CATALOG_DDL
from ..disk.fsio import open_for_read, read_small
from ..disk.root import StorePaths
from ..disk.sqlite_files import connect_read_only
from ..format.manifest import MAX_MANIFEST_BYTES, Manifest, ObjectRef, decode, encode
from ..sealing import KeyTable, read_key_table, sealed_fact
from .importer import Importer, ImportReport
from .ingest import DigestMismatch, Section
from .places import RootContents, find_stores
from .selection import Candidate, Selection, plan, resolve_deployments

_MAN_RE = re.compile(r"[0-9a-f]{64}\.json")
_ID_RE = re.compile(r"[0-9a-f]{64}")


class SourceVanished(Exception):
    """A peer file disappeared or shrank while it was read."""


class FileSource:
    """One peer object file as an importer ``Source``."""

    def __init__(self, fd: int, size: int):
        self.fd = fd
        self.left = size

    def readinto(self, view: memoryview) -> int:
        want = min(len(view), self.left)
        if want == 0:
            return 0
        n = os.readv(self.fd, [view[:want]])
        if n <= 0:
            raise SourceVanished()
        self.left -= n
        return n

    def skip(self) -> None:
        self.left = 0


def _read_manifest(layout: StorePaths, entry_id: str) -> Manifest | None:
    """The peer's manifest of ``entry_id``; None if it vanished; ManifestError if bad."""
    path = layout.manifest_path(entry_id)
    try:
        data = read_small(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP):
            return None
        raise ManifestError(f"unreadable: {os.strerror(exc.errno or 0)}",
                            reason=QuarantineReason.MANIFEST_IO, path=path) from None
    return decode(data, expected_entry_id=entry_id, path=str(path))


def _scan(place: str, root: Path, counts: dict[str, int],
          sealed: set[tuple[str, int]] | None = None) -> list[Candidate]:
    """The peer's entries as candidates; ``sealed`` collects the (tenant id, key version)
    of its encrypted ones."""
    layout = StorePaths(root)
    out: list[Candidate] = []
    try:
        fans = sorted(os.listdir(layout.manifests))
    except OSError:
        return out
    for fan in fans:
        try:
            names = os.listdir(layout.manifests / fan)
        except OSError:
            continue
        for name in names:
            if not _MAN_RE.fullmatch(name) or not name.startswith(fan):
                continue
            try:
                m = _read_manifest(layout, name[:-5])
            except ManifestError:
                counts["corrupt"] = counts.get("corrupt", 0) + 1
                continue
            if m is not None:
                if sealed is not None and (fact := sealed_fact(m.index)) is not None:
                    sealed.add(fact)
                size = m.payload_bytes + len(encode(m))
                out.append(Candidate(place, m.entry_id, m.kind, m.namespace, m.key, size,
                                     m.created))
    return out


def _released(root: Path) -> frozenset[str]:
    """The entries the peer store at ``root`` holds released, from an immutable snapshot
    of its catalog (nothing created or locked); empty if it cannot be read so."""
    path = StorePaths(root).state / "catalog.sqlite3"
    try:
        db = connect_read_only(path, timeout=5, ddl=CATALOG_DDL, snapshot=True)
    except (SpoolError, OSError, sqlite3.DatabaseError):
        return frozenset()
    try:
        rows = db.execute("SELECT entry_id FROM entries WHERE hint = 'release' "
                          "AND state = 'committed'").fetchall()
    except sqlite3.DatabaseError:
        return frozenset()
    finally:
        db.close()
    return frozenset(r[0] for r in rows if isinstance(r[0], str) and _ID_RE.fullmatch(r[0]))


def import_from_root(importer: Importer, source: str | os.PathLike[str],
                     selection: Selection | None = None, *, layout: RootContents | None = None
                     ) -> ImportReport:
    """Copy the entries of the stores under the peer root ``source`` chosen by
    ``selection`` (newest first) into ``importer``'s target (``layout``: ``source``
    already classified by the caller)."""
    selection = dataclasses.replace(selection or Selection(), hint=None)
    layout = layout if layout is not None else find_stores(source)
    stores = list(layout.stores)
    if selection.deployments:
        wanted = resolve_deployments(selection.deployments, layout.deployments)
        stores = [s for s in stores if s.place and s.place.split("/", 1)[0] in wanted]
    places = [(s.archive_place, s.path) for s in stores]
    scan_counts: dict[str, int] = {}
    sealed: dict[str, set[tuple[str, int]]] = {place: set() for place, _ in places}
    candidates = {place: _scan(place, path, scan_counts, sealed[place])
                  for place, path in places}
    # The wrapped keys of the peer's encrypted entries, read from its keyring as they are.
    keys: dict[str, KeyTable] = {}
    for place, path in places:
        table = read_key_table(StorePaths(path).state, sealed[place]) \
            if sealed[place] else None
        if table is not None and table.keys:
            keys[place] = table
    released = {place: _released(path) for place, path in places}
    chosen = plan(candidates, selection, quorum=layout.quorum)
    per_place = chosen.by_place()
    roots = {place: StorePaths(path) for place, path in places}

    def body() -> None:
        importer.prepare({p: sum(c.size for c in per_place.get(p, [])) for p in roots},
                         strict=False, released=released, keys=keys)
        copied = 0
        emitted: dict[str, set[str]] = {p: set() for p in roots}
        for c in chosen.parts:
            sec = importer.section(c.place)
            copied += _copy_entry(sec, roots[c.place], c, emitted[c.place])
            importer.entry_done(copied)
        importer.report.source_bytes = copied

    report = importer.run(body, str(layout.path))
    if report.places:
        report.places[0].skipped_corrupt += scan_counts.get("corrupt", 0)
    return report


def _copy_entry(sec: Section, peer: StorePaths, c: Candidate, emitted: set[str]) -> int:
    """Feed one peer entry to ``sec``; return the bytes read from the peer."""
    try:
        manifest = _read_manifest(peer, c.entry_id)
    except ManifestError:
        sec.tally.skipped_corrupt += 1
        return 0
    if manifest is None:
        sec.tally.skipped_vanished += 1
        return 0
    read = 0
    new: list[ObjectRef] = []
    for ref in manifest.objects:
        if ref.digest not in emitted and all(ref.digest != r.digest for r in new):
            new.append(ref)
    for ref in new:
        try:
            fd = open_for_read(peer.object_path(ref.digest))
        except OSError:
            sec.abort_entry()
            sec.tally.skipped_vanished += 1
            return read
        try:
            if os.fstat(fd).st_size != ref.size:
                sec.abort_entry()
                sec.tally.skipped_corrupt += 1
                return read
            sec.on_object(ref.digest, ref.size, FileSource(fd, ref.size))
            read += ref.size
        except SourceVanished:
            sec.abort_entry()
            sec.tally.skipped_vanished += 1
            return read
        except DigestMismatch:
            sec.abort_entry()
            sec.tally.skipped_corrupt += 1
            return read
        finally:
            os.close(fd)
    sec.on_manifest(manifest.entry_id, encode(manifest))
    emitted.update(r.digest for r in new)
    return read
