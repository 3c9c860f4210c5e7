"""The export archive format: member names, index and end record, tar framing (no store I/O).

An archive is a plain POSIX ustar stream that ``tar -tvf`` lists and ``tar -xf`` unpacks
into the store layout (``docs/format.md``)::

    spoolctl-archive.json                          index: what the archive plans to hold
    [<deployment>/rank-NNNN/]objects/ab/<digest>.obj     payloads, named by their digest
    [<deployment>/rank-NNNN/]manifests/cd/<entry>.json   manifest envelopes, after their objects
    ...
    spoolctl-archive-end.json                      end record: exactly what it holds

A *place* is where a store lives relative to the exported root: ``""`` for a single store,
``<deployment digest>/rank-NNNN`` for a rank store of the vLLM connector. Within a place,
every object appears once, before the first manifest that names it, and every object
member is named by the manifest that follows it (the importer refuses anything else).

Only regular-file members with names of this grammar are accepted by ``TarReader``.
Everything here is pure except ``TarWriter``/``TarReader``, which touch only their stream.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import tarfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...errors import ArchiveError
from ..format.keys import KINDS
from ..format.manifest import MAX_MANIFEST_BYTES, MAX_OBJECT_SIZE
from ..format.rankdirs import DEPLOYMENT_NAME, RANK_DIGITS, rank_dirname
from ..sealing import KeyTable

SCHEMA = "spoolctl-archive/v1"
END_SCHEMA = "spoolctl-archive-end/v1"
INDEX_NAME = "spoolctl-archive.json"
END_NAME = "spoolctl-archive-end.json"
BLOCK = 512
RECORD = 20 * BLOCK  # tar's default record size: the stream is padded to a multiple of it
MAX_INDEX_BYTES = 4 << 20
MAX_STORES = 4096
MAX_COUNT = 1 << 62
# Bytes after the end-of-archive marker that are drained (and must be zero) before giving up.
MAX_TAIL = 1 << 20
# A signed stream (``export -o - --sign-key``) ends, after the zero padding, with one
# signature trailer of exactly this size that starts with this magic (``archive_sign``).
TRAILER_MAGIC = b"spoolctl-archive-sig-trailer/v1\n"
TRAILER_BYTES = 1024

_ENTRY_ID_RE = re.compile(r"[0-9a-f]{64}")
_PLACE_RE = re.compile(rf"(?P<deployment>{DEPLOYMENT_NAME})/rank-(?P<rank>{RANK_DIGITS})")
_MEMBER_RE = re.compile(
    rf"(?:(?P<place>{DEPLOYMENT_NAME}/rank-{RANK_DIGITS})/)?(?P<area>objects|manifests)/"
    r"(?P<fan>[0-9a-f]{2})/(?P<hex>[0-9a-f]{64})\.(?P<ext>obj|json)")
_TYPE_NAMES = {
    tarfile.SYMTYPE: "a symbolic link", tarfile.LNKTYPE: "a hard link",
    tarfile.DIRTYPE: "a directory", tarfile.FIFOTYPE: "a FIFO", tarfile.CHRTYPE: "a device",
    tarfile.BLKTYPE: "a device", tarfile.XHDTYPE: "a pax header", tarfile.XGLTYPE: "a pax header",
    tarfile.GNUTYPE_LONGNAME: "a GNU long name", tarfile.GNUTYPE_LONGLINK: "a GNU long link",
    tarfile.GNUTYPE_SPARSE: "a sparse file", tarfile.CONTTYPE: "a contiguous file",
}


# -- places and member names --------------------------------------------------------------


def validate_place(place: object) -> str:
    """``""`` or ``<deployment>/rank-NNNN`` (one safe component each); else ArchiveError."""
    if isinstance(place, str) and (place == "" or _PLACE_RE.fullmatch(place)):
        return place
    raise ArchiveError(f"invalid store place {str(place)[:80]!r} in the archive",
                       fix="the archive was not written by `spoolctl export`")


def deployment_of(place: str) -> str | None:
    """The deployment directory name of a rank place, None for a single store."""
    m = _PLACE_RE.fullmatch(place)
    return m.group("deployment") if m else None


def rank_of(place: str) -> int | None:
    m = _PLACE_RE.fullmatch(place)
    return int(m.group("rank")) if m else None


def place_for(deployment: str, rank: int) -> str:
    """The place of rank store ``rank`` of ``deployment``; ArchiveError if a name cannot
    be carried."""
    try:
        name = rank_dirname(rank)
    except ValueError as exc:
        raise ArchiveError(str(exc), fix="the archive was not written by `spoolctl export`") \
            from None
    return validate_place(f"{deployment}/{name}")


def _prefix(place: str) -> str:
    return f"{place}/" if place else ""


def object_member(place: str, digest: str) -> str:
    return f"{_prefix(place)}objects/{digest[:2]}/{digest}.obj"


def manifest_member(place: str, entry_id: str) -> str:
    return f"{_prefix(place)}manifests/{entry_id[:2]}/{entry_id}.json"


@dataclass(frozen=True)
class Member:
    """One archive member: ``area`` is ``index``, ``end``, ``object`` or ``manifest``;
    ``hexid`` is the object digest or entry id its name states."""

    name: str
    area: str
    size: int
    place: str = ""
    hexid: str = ""


def parse_member(name: str, size: int) -> Member:
    """Classify a member by its name and size; ArchiveError for anything off-grammar."""
    if not isinstance(size, int) or size < 0:  # a base-256 size field can be negative
        raise ArchiveError(f"member {_show(name)} has an invalid size ({size})",
                           fix="the archive is damaged or hostile; do not import it")
    if name == INDEX_NAME:
        if size > MAX_INDEX_BYTES:
            raise ArchiveError(f"archive index is {size} bytes (limit {MAX_INDEX_BYTES})",
                               fix="the archive was not written by `spoolctl export`")
        return Member(name, "index", size)
    if name == END_NAME:
        if size > MAX_INDEX_BYTES:
            raise ArchiveError(f"archive end record is {size} bytes (limit {MAX_INDEX_BYTES})",
                               fix="the archive was not written by `spoolctl export`")
        return Member(name, "end", size)
    m = _MEMBER_RE.fullmatch(name)
    if not m or m.group("fan") != m.group("hex")[:2] or \
            (m.group("area") == "objects") != (m.group("ext") == "obj"):
        raise ArchiveError(f"unexpected member name {_show(name)}",
                           fix="an archive holds only spoolctl objects and manifests; "
                               "use one written by `spoolctl export`")
    area = "object" if m.group("area") == "objects" else "manifest"
    limit = MAX_OBJECT_SIZE if area == "object" else MAX_MANIFEST_BYTES
    if size > limit:
        raise ArchiveError(f"member {_show(name)} claims {size} bytes (limit {limit})",
                           fix="the archive is damaged or hostile; do not import it")
    return Member(name, area, size, m.group("place") or "", m.group("hex"))


def _show(text: str) -> str:
    """A member name for an error line: bounded and with control characters escaped."""
    return repr(text[:160])


# -- index and end record -----------------------------------------------------------------


def _count(doc: Mapping[str, Any], key: str, where: str) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNT:
        raise ArchiveError(f"{where}: {key} must be a non-negative integer",
                           fix="the archive was not written by `spoolctl export`")
    return value


def _load_json(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ArchiveError(f"archive {what} is not valid JSON",
                           fix="the archive is damaged; export it again") from None
    if not isinstance(doc, dict):
        raise ArchiveError(f"archive {what} is not a JSON object",
                           fix="the archive is damaged; export it again")
    return doc


@dataclass(frozen=True)
class StoreSection:
    """What the index plans for one store of the archive (upper bounds: entries evicted
    while exporting are left out, so the end record may hold fewer)."""

    place: str
    entries: int
    bytes: int
    store_id: str = ""
    kinds: Mapping[str, int] = field(default_factory=dict)
    deployment: Mapping[str, Any] | None = None
    # Entries the source holds released, kept released by an import. Absent from the JSON
    # when empty, so archives of live entries stay what earlier versions wrote.
    released: frozenset[str] = frozenset()
    # The wrapped data keys of its encrypted entries; absent from the JSON when there are
    # none, so plain archives are unchanged.
    keys: KeyTable | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"place": self.place, "entries": self.entries, "bytes": self.bytes,
               "store_id": self.store_id, "kinds": dict(self.kinds),
               "deployment": dict(self.deployment) if self.deployment else None}
        if self.released:
            doc["released"] = sorted(self.released)
        if self.keys is not None and self.keys.keys:
            doc["keys"] = self.keys.to_json()
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> StoreSection:
        if not isinstance(doc, dict):
            raise ArchiveError("archive index: a store is not an object",
                               fix="the archive was not written by `spoolctl export`")
        place = validate_place(doc.get("place"))
        kinds = doc.get("kinds") or {}
        if not isinstance(kinds, dict) or any(k not in KINDS for k in kinds):
            raise ArchiveError("archive index: unknown entry kind",
                               fix="the archive was not written by `spoolctl export`")
        for kind in kinds:
            _count(kinds, kind, "archive index kinds")
        dep = doc.get("deployment")
        store_id = doc.get("store_id", "")
        if (dep is not None and not isinstance(dep, dict)) or not isinstance(store_id, str):
            raise ArchiveError("archive index: malformed store description",
                               fix="the archive was not written by `spoolctl export`")
        entries = _count(doc, "entries", "archive index")
        released = doc.get("released", [])
        if not isinstance(released, list) or len(released) > entries or \
                not all(isinstance(e, str) and _ENTRY_ID_RE.fullmatch(e) for e in released):
            raise ArchiveError("archive index: malformed list of released entries",
                               fix="the archive was not written by `spoolctl export`")
        keys = KeyTable.from_json(doc["keys"]) if "keys" in doc else None
        return cls(place=place, entries=entries,
                   bytes=_count(doc, "bytes", "archive index"), store_id=store_id[:64],
                   kinds=dict(kinds), deployment=dep, released=frozenset(released), keys=keys)


@dataclass(frozen=True)
class ArchiveIndex:
    """The first member: the stores the archive holds and their planned sizes."""

    stores: tuple[StoreSection, ...]
    created: float = 0.0
    tool: str = ""

    def __post_init__(self) -> None:
        places = [s.place for s in self.stores]
        if len(set(places)) != len(places):
            raise ArchiveError("archive index lists a store twice",
                               fix="the archive was not written by `spoolctl export`")
        if len(places) > MAX_STORES:
            raise ArchiveError(f"archive index lists more than {MAX_STORES} stores",
                               fix="the archive was not written by `spoolctl export`")

    @property
    def entries(self) -> int:
        return sum(s.entries for s in self.stores)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.stores)

    def section(self, place: str) -> StoreSection | None:
        return next((s for s in self.stores if s.place == place), None)

    def to_bytes(self) -> builtins.bytes:
        return json.dumps({"schema": SCHEMA, "created": self.created, "tool": self.tool,
                           "stores": [s.to_json() for s in self.stores]},
                          sort_keys=True, indent=1).encode() + b"\n"

    @classmethod
    def from_bytes(cls, data: builtins.bytes) -> ArchiveIndex:
        doc = _load_json(data, "index")
        if doc.get("schema") != SCHEMA:
            raise ArchiveError(f"archive index has schema {str(doc.get('schema'))[:40]!r}, "
                               f"expected {SCHEMA!r}",
                               fix="import it with the spoolctl version that exported it")
        stores = doc.get("stores")
        if not isinstance(stores, list) or len(stores) > MAX_STORES:
            raise ArchiveError("archive index: stores is not a list",
                               fix="the archive was not written by `spoolctl export`")
        created = doc.get("created", 0.0)
        tool = doc.get("tool", "")
        return cls(stores=tuple(StoreSection.from_json(s) for s in stores),
                   created=float(created) if isinstance(created, (int, float)) else 0.0,
                   tool=str(tool)[:80])


@dataclass
class SectionCount:
    """What one store of the archive actually holds (kept while writing or reading)."""

    place: str
    entries: int = 0
    objects: int = 0
    bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"place": self.place, "entries": self.entries, "objects": self.objects,
                "bytes": self.bytes}


def end_record(counts: Iterable[SectionCount]) -> bytes:
    return json.dumps({"schema": END_SCHEMA, "stores": [c.to_json() for c in counts]},
                      sort_keys=True, indent=1).encode() + b"\n"


def parse_end_record(data: bytes) -> dict[str, SectionCount]:
    doc = _load_json(data, "end record")
    if doc.get("schema") != END_SCHEMA or not isinstance(doc.get("stores"), list):
        raise ArchiveError("archive end record is malformed",
                           fix="the archive was not written by `spoolctl export`")
    out: dict[str, SectionCount] = {}
    for item in doc["stores"][:MAX_STORES + 1]:
        if not isinstance(item, dict):
            raise ArchiveError("archive end record is malformed",
                               fix="the archive was not written by `spoolctl export`")
        place = validate_place(item.get("place"))
        if place in out:
            raise ArchiveError("archive end record lists a store twice",
                               fix="the archive was not written by `spoolctl export`")
        out[place] = SectionCount(place, *(_count(item, k, "archive end record")
                                           for k in ("entries", "objects", "bytes")))
    return out


# -- tar framing ---------------------------------------------------------------------------


def tar_header(name: str, size: int, mtime: float) -> bytes:
    """A ustar header for a regular file (mode 0600, no owner names): long names use the
    ustar prefix field, never a pax or GNU extension, so every tar reads it."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o600
    info.mtime = int(max(0.0, mtime))
    info.type = tarfile.REGTYPE
    info.uname = info.gname = ""
    return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="ascii", errors="strict")


def padding(size: int) -> int:
    return -size % BLOCK


class TarWriter:
    """Writes members to ``sink`` (a callable taking a list of buffers, e.g. ``FdSink``)."""

    def __init__(self, sink: Callable[[list[bytes | memoryview]], None]):
        self._sink = sink
        self.offset = 0
        self.closed = False

    def add(self, name: str, data: bytes | memoryview, mtime: float) -> None:
        """One member whose bytes are in memory (header, data and padding in one write)."""
        self.begin(name, len(data), mtime, [data])
        self.finish(len(data))

    def begin(self, name: str, size: int, mtime: float,
              first: list[bytes | memoryview] | None = None) -> None:
        """Start a member of ``size`` bytes; stream the rest with ``write`` then ``finish``."""
        bufs: list[bytes | memoryview] = [tar_header(name, size, mtime), *(first or [])]
        self._put(bufs)

    def write(self, data: bytes | memoryview) -> None:
        self._put([data])

    def finish(self, size: int) -> None:
        pad = padding(size)
        if pad:
            self._put([bytes(pad)])

    def close(self) -> None:
        """The end-of-archive marker (two zero blocks), padded to a whole record."""
        if self.closed:
            return
        end = 2 * BLOCK
        end += -(self.offset + end) % RECORD
        self._put([bytes(end)])
        self.closed = True

    def _put(self, bufs: list[bytes | memoryview]) -> None:
        self._sink(bufs)
        self.offset += sum(len(b) for b in bufs)


class FdSink:
    """Writes buffer lists to a file descriptor (``writev``; partial writes resumed)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __call__(self, bufs: list[bytes | memoryview]) -> None:
        views = [memoryview(b).cast("B") for b in bufs if len(b)]
        while views:
            n = os.writev(self.fd, views[:1024])
            while n and views:
                if n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][n:]
                    n = 0


class Stream(Protocol):
    """A binary stream an archive is read from."""

    def readinto(self, buffer: memoryview, /) -> int | None: ...


class TarReader:
    """Reads members from a binary stream, strictly: regular files with grammar names only.

    ``next()`` returns the next ``Member`` or None at the end-of-archive marker or at EOF on
    a member boundary (``clean_eof`` tells which). ``readinto`` reads the current member's
    data; EOF inside it is an ArchiveError ("truncated").
    """

    def __init__(self, stream: Stream):
        self._stream = stream
        self.offset = 0
        self.member: Member | None = None
        self._left = 0
        self._pad = 0
        self.clean_eof = False
        self.ended = False

    def _read_exact(self, view: memoryview) -> int:
        got = 0
        while got < len(view):
            n = self._stream.readinto(view[got:])
            if not n:
                break
            got += n
        self.offset += got
        return got

    def next(self) -> Member | None:
        if self.ended:
            return None
        self.skip()
        block = memoryview(bytearray(BLOCK))
        got = self._read_exact(block)
        if got == 0:
            self.ended, self.clean_eof = True, False
            self.member = None
            return None
        if got < BLOCK:
            raise ArchiveError(f"archive truncated inside a header at byte {self.offset}",
                               fix="the transfer was cut short; export and import again")
        raw = bytes(block)
        if raw == bytes(BLOCK):
            self.ended, self.clean_eof = True, True
            self.member = None
            self._drain_tail()
            return None
        try:
            info = tarfile.TarInfo.frombuf(raw, "utf-8", "strict")
        except (tarfile.HeaderError, UnicodeDecodeError, ValueError) as exc:
            raise ArchiveError(f"invalid tar header at byte {self.offset - BLOCK} "
                               f"({str(exc)[:60] or type(exc).__name__})",
                               fix="this is not a spoolctl archive, or it is damaged") from None
        if info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
            what = _TYPE_NAMES.get(info.type, f"of type {info.type!r}")
            raise ArchiveError(f"member {_show(info.name)} is {what}; only regular files "
                               "are allowed", fix="the archive is hostile or not from "
                                                  "`spoolctl export`; do not import it")
        self.member = parse_member(info.name, info.size)
        self._left = info.size
        self._pad = padding(info.size)
        return self.member

    def readinto(self, view: memoryview) -> int:
        """Read up to ``len(view)`` bytes of the current member (0 when it is consumed)."""
        want = min(len(view), self._left)
        if want == 0:
            return 0
        got = self._read_exact(view[:want])
        if got < want:
            name = self.member.name if self.member else "?"
            raise ArchiveError(f"archive truncated inside member {_show(name)} "
                               f"({self._left - got} of its bytes missing)",
                               fix="the transfer was cut short; export and import again")
        self._left -= got
        if self._left == 0:
            self._consume_padding()
        return got

    def read_all(self) -> bytes:
        """The whole current member (only for small members: index, manifests)."""
        buf = bytearray(self._left)
        view = memoryview(buf)
        pos = 0
        while pos < len(buf):
            pos += self.readinto(view[pos:])
        if self._left == 0 and self._pad:
            self._consume_padding()
        return bytes(buf)

    def skip(self) -> None:
        """Discard what is left of the current member."""
        if self._left:
            scratch = memoryview(bytearray(min(self._left, 1 << 20)))
            while self._left:
                self.readinto(scratch[:min(self._left, len(scratch))])
        self._consume_padding()

    def _consume_padding(self) -> None:
        if self._pad:
            pad = memoryview(bytearray(self._pad))
            if self._read_exact(pad) < self._pad:
                raise ArchiveError("archive truncated inside a member's padding",
                                   fix="the transfer was cut short; export and import again")
            self._pad = 0

    def _drain_tail(self) -> None:
        """After the end marker: read to EOF (a pipe's writer must not see EPIPE), at most
        ``MAX_TAIL`` bytes, all zero but for one signature trailer at the very end;
        ArchiveError for anything else."""
        buf = memoryview(bytearray(64 << 10))
        total = 0
        kept = b""  # the non-zero tail seen so far: only a trailer may be there
        while True:
            n = self._stream.readinto(buf)
            if not n:
                break
            total += n
            self.offset += n
            chunk = bytes(buf[:n])
            if kept or chunk.strip(b"\0"):
                kept += chunk if kept else chunk.lstrip(b"\0")
            if total > MAX_TAIL or len(kept) > TRAILER_BYTES or \
                    (kept and not TRAILER_MAGIC.startswith(kept[:len(TRAILER_MAGIC)])):
                break
        if (kept and not (len(kept) == TRAILER_BYTES and kept.startswith(TRAILER_MAGIC))) or \
                total > MAX_TAIL:
            raise ArchiveError(f"data after the end of the archive (byte {self.offset})",
                               fix="the archive is damaged or two archives were "
                                   "concatenated; import them one at a time")
