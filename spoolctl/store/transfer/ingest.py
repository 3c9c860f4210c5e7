"""Receive one store of an import: stage objects verified, check manifests, batch commits.

``Section`` is fed the members of one source store in order (objects, then the manifest
that names them). It stages each object verified (``stage_object``), checks the manifest
that follows, applies the capacity rules (never above the low watermark, never a full disk,
never evicting) and publishes complete entries in batches. Archives are strict
(``ArchiveError`` on any defect); a peer's corrupt or vanished entry is skipped.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ...errors import ArchiveError, ManifestError
from ..capacity import low_watermark
from ..disk import dirfd
from ..disk.fsio import fsync_close, io_error, tmp_name, unlink_quietly
from ..format.digest import Hasher
from ..format.manifest import decode, encode, envelope_digest
from ..sealing import sealed_fact
from ..store import Store
from .import_commit import StagedEntry, object_present, publish_entries

COPY_CHUNK = 1 << 20
# Objects up to this size are hashed on the reading thread (see stage_object).
INLINE_HASH_MAX = 4 << 20
BATCH_BYTES = 512 << 20
BATCH_ENTRIES = 4096
# Never fill a disk to the last byte: keep this much free (less on a tiny filesystem).
DISK_RESERVE = 64 << 20
# Staged objects whose flush to disk may be in flight at once (each holds a thread's fd).
MAX_FLUSHING = 64
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class Source(Protocol):
    """The bytes of one object member: ``readinto`` until its size is read, or ``skip``."""

    def readinto(self, view: memoryview) -> int: ...

    def skip(self) -> None: ...


class DigestMismatch(Exception):
    """A staged object's bytes do not match its name (raised by ``stage_object``)."""


@dataclass
class PlaceTally:
    """What the import did for one store of the source."""

    place: str
    root: str = ""
    imported: int = 0
    present: int = 0
    skipped_capacity: int = 0
    skipped_vanished: int = 0
    skipped_corrupt: int = 0
    skipped_unauthenticated: int = 0  # the target has a tag key; the entry no valid tag
    # encrypted entries whose data key this store cannot use: a revoked tenant's, or one the
    # archive did not carry
    skipped_key: int = 0
    keys_added: int = 0  # wrapped data keys the archive brought into the keyring
    keys_refused: int = 0  # ... and those not taken (revoked or erased here)
    filtered: int = 0
    objects_written: int = 0
    objects_present: int = 0
    bytes_written: int = 0
    created: bool = False
    released: int = 0  # of ``imported``: kept released, as the source had them

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _drain(source: Source) -> None:
    source.skip()


def stage_object(store: Store, source: Source, size: int, digest: str,
                 pool: ThreadPoolExecutor) -> Path:
    """Copy ``size`` bytes of ``source`` into a new file in the store's ``tmp/``, hashing
    them on the way (over ``INLINE_HASH_MAX`` on ``pool``). Returns the file (not fsynced)
    if its digest is ``digest``; otherwise deletes it and raises DigestMismatch.
    ArchiveError if the source ends early, StoreIOError if the disk fails."""
    if size < 0:
        raise ArchiveError(f"object {digest} has a negative size",
                           fix="the source is damaged or hostile; do not import it")
    # Buffers before the file: nothing that can fail lies between its creation and the try.
    hasher = Hasher()
    n_buf = min(COPY_CHUNK, size)
    # A small object is hashed on this thread between read and write: a hand-off per
    # chunk to the pool costs more than hashing the chunk.
    inline = size <= INLINE_HASH_MAX
    bufs = [memoryview(bytearray(n_buf))] if size and inline else \
        [memoryview(bytearray(n_buf)), memoryview(bytearray(n_buf))] if size else []
    path = store.layout.tmp / tmp_name()
    try:  # through tmp/'s descriptor: never into a tmp/ swapped for a link
        fd = dirfd.create(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise io_error(exc, "creating a temporary file", path) from exc
    pending: Future[None] | None = None
    try:
        try:
            left, i = size, 0
            while left:
                view = bufs[i][:min(COPY_CHUNK, left)]
                got = 0
                while got < len(view):
                    n = source.readinto(view[got:])
                    if not n:
                        raise ArchiveError("source ended inside an object",
                                           fix="the transfer was cut short; run it again")
                    got += n
                if inline:
                    hasher.update(view)
                else:
                    if pending is not None:
                        pending.result()  # the hasher takes chunks in order
                    pending = pool.submit(hasher.update, view)
                rest = view
                while rest:
                    rest = rest[os.write(fd, rest):]
                left -= got
                i ^= len(bufs) - 1
        finally:
            if pending is not None:
                pending.result()
            os.close(fd)
    except OSError as exc:
        unlink_quietly(path)
        raise io_error(exc, "writing an imported object", path) from exc
    except BaseException:
        unlink_quietly(path)
        raise
    if hasher.hexdigest() != digest:
        unlink_quietly(path)
        raise DigestMismatch(digest)
    return path


def fsync_if_present(path: Path) -> None:
    """Flush a staged file to disk (it may have been discarded meanwhile: then nothing)."""
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
    except FileNotFoundError:
        return
    fsync_close(fd)


def free_bytes(path: Path) -> int:
    """Free bytes for this user on the filesystem of ``path`` (or its nearest parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    st = os.statvfs(path)
    size = st.f_blocks * st.f_frsize
    return max(0, st.f_bavail * st.f_frsize - min(DISK_RESERVE, size // 20))


class Section:
    """One target store receiving one store (place) of the source."""

    def __init__(self, store: Store, tally: PlaceTally, pool: ThreadPoolExecutor,
                 flusher: ThreadPoolExecutor, *,
                 strict: bool, wants: Callable[[Any], bool] | None = None,
                 skip_all: bool = False, retag: bool = False):
        self.store = store
        # With a tag key on the target: an entry whose tag this key does not verify is
        # skipped, unless the operator vouches for the source (``retag``): then it is
        # tagged anew. Without a key, tags travel as they are.
        self.retag = retag
        self.tally = tally
        self.pool = pool
        self.flusher = flusher
        self.flushing: list[Future[None]] = []
        self.strict = strict  # archive rules (an unexpected member is a defect)
        self.wants = wants
        self.skip_all = skip_all
        self.pending: dict[str, tuple[Path, int]] = {}
        self.pending_present: set[str] = set()
        self.pending_dropped: set[str] = set()
        self.batch: list[StagedEntry] = []
        self.batch_staged: dict[str, int] = {}
        self.batch_bytes = 0
        self.dropped: set[str] = set()
        self.seen: set[str] = set()
        # Entries the source holds released: imported released (cleanup backlog stays
        # backlog).
        self.released: frozenset[str] = frozenset()
        self._room = 0
        self.refresh_room()

    # -- capacity ----------------------------------------------------------------------

    def refresh_room(self) -> None:
        """Bytes this store may still take (low watermark of its max, and the disk)."""
        room = free_bytes(self.store.root)
        if self.store.max_bytes is not None:
            room = min(room, low_watermark(self.store.max_bytes)
                       - self.store.totals().bytes)
        self._room = room

    @property
    def room(self) -> int:
        staged = sum(s for _p, s in self.pending.values())
        return self._room - self.batch_bytes - staged

    # -- members -------------------------------------------------------------------------

    def _once(self, tag: str) -> None:
        if tag in self.seen:
            raise ArchiveError(f"duplicated member ({'object' if tag[0] == 'o' else 'manifest'}"
                               f" {tag[1:]}) in the archive",
                               fix="the archive is damaged or hostile; do not import it")
        self.seen.add(tag)

    def on_object(self, digest: str, size: int, source: Source) -> None:
        self._once("o" + digest)
        if self.skip_all:
            return _drain(source)
        path = self.store.layout.object_path(digest)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_size == size:
                self.pending_present.add(digest)
                self.tally.objects_present += 1
                return _drain(source)
        if size > self.room:
            self.pending_dropped.add(digest)
            return _drain(source)
        try:
            staged = stage_object(self.store, source, size, digest, self.pool)
        except DigestMismatch:
            if not self.strict:
                raise  # a peer root's corrupt object: the caller skips the entry
            raise ArchiveError(f"object {digest} does not match its digest",
                               fix="the archive is damaged in transit or on disk; export "
                                   "it again") from None
        self.pending[digest] = (staged, size)
        # Start its flush to disk now, overlapping the next reads; the batch waits for it.
        self.flushing.append(self.flusher.submit(fsync_if_present, staged))
        if len(self.flushing) > MAX_FLUSHING:
            try:
                self.flushing.pop(0).result()
            except OSError as exc:
                raise io_error(exc, "flushing an imported object", staged) from exc

    def abort_entry(self) -> None:
        """Forget the objects read since the last manifest (a peer entry that vanished)."""
        for digest, (path, _size) in self.pending.items():
            unlink_quietly(path)
            self.seen.discard("o" + digest)
        for digest in self.pending_present | self.pending_dropped:
            self.seen.discard("o" + digest)
        self._reset_entry()

    def _reset_entry(self) -> None:
        self.pending, self.pending_present, self.pending_dropped = {}, set(), set()

    def _discard_entry(self, *, dropped: bool) -> None:
        for digest, (path, _size) in self.pending.items():
            unlink_quietly(path)
            if dropped:
                self.dropped.add(digest)
        if dropped:
            self.dropped.update(self.pending_dropped)
        self._reset_entry()

    def on_manifest(self, entry_id: str, data: bytes) -> None:
        self._once("m" + entry_id)
        if self.skip_all:
            self.tally.filtered += 1
            return
        try:
            manifest = decode(data, expected_entry_id=entry_id)
        except ManifestError as exc:
            raise ArchiveError(f"manifest {entry_id} in the archive is invalid "
                               f"({exc.message})", fix="the archive is damaged or hostile; "
                               "do not import it") from None
        named = {r.digest for r in manifest.objects}
        loose = (set(self.pending) | self.pending_present | self.pending_dropped) - named
        if loose:
            raise ArchiveError(f"object {min(loose)} precedes manifest {entry_id} but is not "
                               "named by it", fix="the archive was not written by "
                               "`spoolctl export`; do not import it")
        doomed = False
        for ref in manifest.objects:
            have = self.pending[ref.digest][1] if ref.digest in self.pending else \
                self.batch_staged.get(ref.digest)
            if have is not None:
                if have != ref.size:
                    raise ArchiveError(
                        f"object {ref.digest} is {have} bytes in the archive, manifest "
                        f"{entry_id} says {ref.size}", fix="the archive is damaged or hostile")
            elif ref.digest in self.pending_dropped or ref.digest in self.dropped:
                doomed = True
            elif ref.digest not in self.pending_present and ("o" + ref.digest) not in \
                    self.seen and not object_present(self.store.layout, ref):
                raise ArchiveError(f"manifest {entry_id} names object {ref.digest} that the "
                                   "archive lacks", fix="the archive is incomplete or hostile; "
                                   "export it again")
        if self.wants is not None and not self.wants(manifest):
            self.tally.filtered += 1
            return self._discard_entry(dropped=False)
        if doomed:
            self.tally.skipped_capacity += 1
            return self._discard_entry(dropped=True)
        row = self.store.row(entry_id)
        if row is not None and row.state == "committed":
            self.tally.present += 1
            return self._discard_entry(dropped=False)
        if not self._readable(manifest):
            self.tally.skipped_key += 1
            return self._discard_entry(dropped=False)
        key = self.store.tag_key
        fresh = None
        if key is not None and key.problem(manifest.tag, envelope_digest(manifest)):
            if not self.retag:
                self.tally.skipped_unauthenticated += 1
                return self._discard_entry(dropped=False)
            fresh = key
        body = encode(manifest, fresh)
        if len(body) > self.room:
            self.tally.skipped_capacity += 1
            return self._discard_entry(dropped=True)
        staged = {d: p for d, (p, _s) in self.pending.items()}
        self.batch.append(StagedEntry(manifest, body, staged,
                                      "release" if entry_id in self.released else "retain"))
        for d, (_p, s) in self.pending.items():
            self.batch_staged[d] = s
        self.batch_bytes += sum(s for _p, s in self.pending.values()) + len(body)
        self._reset_entry()
        if self.batch_bytes >= BATCH_BYTES or len(self.batch) >= BATCH_ENTRIES:
            self.flush()

    def _readable(self, manifest: Any) -> bool:
        """False for an encrypted entry whose data key this store does not hold (after the
        archive's keys were merged): published, it would only ever be a miss."""
        fact = sealed_fact(manifest.index)
        sealer = self.store.sealer
        return fact is None or (sealer is not None and sealer.keyring.data_key(*fact) is not None)

    def flush(self) -> None:
        """Publish the entries verified so far (one commit batch)."""
        batch, sizes = self.batch, self.batch_staged
        self.batch, self.batch_staged, self.batch_bytes = [], {}, 0
        flushing, self.flushing = self.flushing, []
        try:
            for fut in flushing:
                fut.result()
        except OSError as exc:
            for entry in batch:
                for path in entry.staged.values():
                    unlink_quietly(path)
            raise io_error(exc, "flushing imported objects", self.store.layout.tmp) from exc
        failed = None
        if batch:
            outcomes = publish_entries(self.store, batch)
            for entry in batch:
                outcome = outcomes.get(entry.manifest.entry_id)
                status = outcome.status if outcome is not None else "failed"
                if status == "committed":
                    self.tally.imported += 1
                    self.tally.released += entry.hint == "release"
                    self.tally.objects_written += len(entry.staged)
                    self.tally.bytes_written += sum(sizes[d] for d in entry.staged) + \
                        len(entry.data)
                elif status == "present":
                    self.tally.present += 1
                elif status == "vanished":
                    self.tally.skipped_vanished += 1
                elif failed is None and outcome is not None:
                    failed = outcome.error
        if failed is not None:
            raise failed
        self.refresh_room()

    def finish(self) -> None:
        """End of the source: an object no manifest claimed is a defect (archives)."""
        loose = set(self.pending) | self.pending_present | self.pending_dropped
        self._discard_entry(dropped=False)
        if loose and self.strict:
            self.flush()
            raise ArchiveError(f"object {min(loose)} is not named by any manifest",
                               fix="the archive was not written by `spoolctl export`")
        self.flush()

    def abandon(self) -> None:
        """On an unexpected error: delete everything staged, publish nothing more."""
        self._discard_entry(dropped=False)
        for entry in self.batch:
            for path in entry.staged.values():
                unlink_quietly(path)
        self.batch, self.batch_staged, self.batch_bytes = [], {}, 0

class SkipSection(Section):
    """A source store that is not imported (not among ``--deployment``): drained."""

    def __init__(self, tally: PlaceTally):
        self.tally = tally
        self.skip_all = True
        self.strict = False
        self.seen = set()
        self.pending, self.pending_present, self.pending_dropped = {}, set(), set()
        self.batch, self.batch_staged, self.batch_bytes = [], {}, 0
        self.dropped = set()
        self.flushing = []

    def refresh_room(self) -> None:
        return None

    def flush(self) -> None:
        return None

