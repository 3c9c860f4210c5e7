"""Verifying an object: one primitive that reads and checks it, one classifier of failures.

Every reader of an object (verified read, scrub, export, commit reuse, restore) goes
through ``verify_object``, and ``classify``/``failed_object`` give every finder the same
quarantine reason (a metrics label): nothing or a special file in its place is
``payload_missing``, a wrong size ``payload_size``, wrong bytes ``payload_digest``. An
object that cannot be read (permissions, I/O error) is not damage: nothing is quarantined.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ...errors import CorruptionError, NotFoundError, QuarantineReason, SpoolError
from ..format.digest import Hasher
from .fsio import (
    HASH_POOL,
    SpecialFileError,
    advise_willneed,
    describe_os_error,
    io_error,
    open_for_read,
)
from .root import StorePaths

# Granularity of the read/hash pipeline (and of the hooks' chunks).
PIPE_CHUNK = 2 << 20
# Objects up to this size are hashed on the reading thread: a hand-off costs more than
# it overlaps.
INLINE_HASH_MAX = 4 << 20
__all__ = ["HASH_POOL"]  # the pipeline's helper (defined in fsio, shared with commits)


def verify_object(
    path: Path, *, digest: str, size: int, into: memoryview | None = None,
    each: Callable[[memoryview], object] | None = None,
    pace: Callable[[int], object] | None = None,
) -> None:
    """Read the object at ``path`` and prove it is ``digest`` of ``size`` bytes, in one pass.

    ``into``: a buffer of ``size`` bytes that receives the object. ``each(chunk)`` sees every
    chunk as read, before the digest is known. ``pace(n)`` is called after each chunk.

    Raises CorruptionError (``payload_size``, ``payload_digest``) if the bytes are not the
    object's, else the OSError of the open or read (``classify`` says what each means).
    Never follows a symlink, never blocks on a FIFO.
    """
    fd = open_for_read(path)
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise CorruptionError(f"is {actual} bytes, manifest says {size}",
                                  reason=QuarantineReason.PAYLOAD_SIZE, path=path)
        if into is not None and len(into) != size:
            raise ValueError("destination buffer has the wrong size")
        hasher = Hasher()
        pipelined = into is not None and size > INLINE_HASH_MAX
        if pipelined:
            # Ask for the whole object at once: the kernel then reads ahead of the
            # pipeline's reads instead of one readahead window at a time.
            advise_willneed(fd)
        scratch = into if into is not None else memoryview(bytearray(min(PIPE_CHUNK, size)))
        pending = None
        offset = 0
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            while offset < size:
                end = min(offset + PIPE_CHUNK, size)
                window = into[offset:end] if into is not None else scratch[:end - offset]
                read_exactly(f, window, path)
                if pipelined:  # hash chunk i on the helper thread while chunk i+1 is read
                    if pending is not None:
                        pending.result()
                    pending = HASH_POOL.submit(hasher.update, window)
                else:
                    hasher.update(window)
                if each is not None:
                    each(window)
                if pace is not None:
                    pace(end - offset)
                offset = end
            if pending is not None:
                pending.result()
            if f.read(1):
                raise CorruptionError("grew while reading",
                                      reason=QuarantineReason.PAYLOAD_SIZE, path=path)
    finally:
        os.close(fd)
    if hasher.hexdigest() != digest:
        raise CorruptionError("digest mismatch", reason=QuarantineReason.PAYLOAD_DIGEST,
                              path=path)


class ReadsInto(Protocol):
    """An unbuffered binary file."""

    def readinto(self, buffer: memoryview, /) -> int | None: ...


def read_exactly(f: ReadsInto, window: memoryview, path: Path,
                 short: str = "shorter than its size while reading") -> memoryview:
    """Fill ``window`` from the unbuffered file ``f`` (short reads retried) and return it;
    CorruptionError(PAYLOAD_SIZE, ``short``) if the file ends first."""
    got = 0
    while got < len(window):
        n = f.readinto(window[got:])
        if not n:
            raise CorruptionError(short, reason=QuarantineReason.PAYLOAD_SIZE, path=path)
        got += n
    return window


def read_verified(path: Path, *, digest: str, size: int,
                  into: memoryview | None = None) -> memoryview:
    """The object at ``path`` read whole (into ``into`` if given, else a new buffer) and
    verified in the same pass (``verify_object``, same errors)."""
    buf = into if into is not None else memoryview(bytearray(size))
    verify_object(path, digest=digest, size=size, into=buf)
    return buf


@dataclass(frozen=True)
class Failure:
    """What a failed verification of one object means. ``reason`` None: not damage
    (unreadable). ``occupied``: something is at the object's path (evidence to move)."""

    reason: QuarantineReason | None
    detail: str
    occupied: bool = True

    @property
    def missing(self) -> bool:
        return self.reason is QuarantineReason.PAYLOAD_MISSING and not self.occupied


def classify(exc: BaseException, name: str) -> Failure:
    """The meaning of ``exc``, raised by ``verify_object`` for object ``name`` (see the module
    docstring). Raises ``exc`` again if it is neither a CorruptionError nor an OSError."""
    if isinstance(exc, CorruptionError):
        return Failure(exc.reason, f"object {name}: {exc.message}")
    if isinstance(exc, SpecialFileError):
        return Failure(QuarantineReason.PAYLOAD_MISSING,
                       f"object {name} is not a regular file ({exc.kind})")
    if isinstance(exc, OSError):
        if exc.errno == errno.ENOENT:
            return Failure(QuarantineReason.PAYLOAD_MISSING, f"object {name} missing",
                           occupied=False)
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW refused the last component: a symlink
            return Failure(QuarantineReason.PAYLOAD_MISSING,
                           f"object {name} is not a regular file (symlink)")
        return Failure(None, f"object {name}: {describe_os_error(exc)}")
    raise exc


class _Quarantines(Protocol):
    """What ``failed_object`` needs of a store."""

    read_only: bool
    layout: StorePaths

    def quarantine_entry(self, entry_id: str, reason: QuarantineReason, detail: str, *,
                         bad_digests: list[str]) -> object: ...


@dataclass(frozen=True)
class ObjectFailure:
    """A verification failure and the error to raise: NotFoundError (deleted meanwhile),
    CorruptionError (quarantined unless read-only) or StoreIOError (unreadable)."""

    failure: Failure
    error: SpoolError


def failed_object(store: _Quarantines, entry_id: str, name: str, digest: str, path: Path,
                  exc: BaseException, *, found_by: str) -> ObjectFailure:
    """Act on ``exc`` from ``verify_object`` for object ``name`` (``digest`` at ``path``) of
    ``entry_id`` the same way whoever found it (``found_by``, recorded in the detail). A
    missing object whose manifest is gone too is a miss. StoreIOError if quarantining
    fails."""
    failure = classify(exc, name)
    if failure.reason is None:
        assert isinstance(exc, OSError)
        return ObjectFailure(failure, io_error(exc, "reading an object", path))
    if failure.missing and not os.path.lexists(store.layout.manifest_path(entry_id)):
        return ObjectFailure(failure, NotFoundError(
            f"entry {entry_id} was deleted", path=path, fix="nothing to do: it is a cache miss"))
    fix = "the entry is a cache miss; inspect the store before using it (`spoolctl doctor`)"
    if not store.read_only:
        store.quarantine_entry(entry_id, failure.reason, f"{found_by}: {failure.detail}",
                               bad_digests=[digest] if failure.occupied else [])
        fix = "the entry was quarantined; it is a cache miss"
    return ObjectFailure(failure, CorruptionError(
        f"entry {entry_id}: {failure.detail}", reason=failure.reason, path=path,
        entry_id=entry_id, fix=fix))
