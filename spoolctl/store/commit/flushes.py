"""The file work of a commit: temp files created ahead, bounded in-flight flushes,
directory fsyncs, the check of an object already in place, and the full-disk refusal."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import CorruptionError, SpoolError
from ..disk.fsio import Flushing, TmpFile, io_error, unlink_quietly
from ..disk.publish import Publisher
from ..disk.reserve import HEADROOM_BYTES
from ..disk.space import INODE_FIX, Space, no_inodes_detail
from ..disk.verify import verify_object
from ..format.manifest import ObjectRef

if TYPE_CHECKING:
    from ..disk.root import StorePaths

# Flushes a batch may have in flight before staging waits for the oldest (each holds a file
# descriptor until its fsync is done).
MAX_FLUSHING = 64



def object_present(layout: StorePaths, ref: ObjectRef) -> bool:
    """True if the store holds a regular file of the right size for ``ref`` (cheap: lstat;
    its bytes are verified by every read and by scrub, like any stored object)."""
    try:
        st = os.lstat(layout.object_path(ref.digest))
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == ref.size


class TmpAhead:
    """The temp files of a batch, created ahead, up to MAX_FLUSHING at a time: together,
    before the flushes they wait on start (``fsio.create_tmp``).

    ``next`` hands out one, or None when one could not be created (the writer then creates
    its own and reports that error for its entry); ``close`` removes those not handed out.
    tmp/ is still checked before each file is created; the writes go through the
    descriptors, so a tmp/ swapped afterwards redirects none of them."""

    def __init__(self, publisher: Publisher, count: int):
        self._publisher = publisher
        self._left = count  # files the batch still needs that are not created yet
        self._ready: deque[TmpFile] = deque()

    def next(self) -> TmpFile | None:
        if not self._ready and self._left > 0:
            for _ in range(min(self._left, MAX_FLUSHING)):
                try:
                    self._ready.append(self._publisher.create_tmp())
                except SpoolError:
                    break
                self._left -= 1
        return self._ready.popleft() if self._ready else None

    def close(self) -> None:
        while self._ready:
            self._ready.popleft().discard()


def bound(flushing: list[Flushing], f: Flushing) -> None:
    """Track ``f``; wait for the oldest flushes while more than MAX_FLUSHING are in flight
    (their results are read later, in order)."""
    flushing.append(f)
    while len(flushing) > MAX_FLUSHING:
        with contextlib.suppress(OSError):
            flushing.pop(0).flushed.result()


def flushed(f: Flushing, what: str) -> None:
    try:
        f.flushed.result()
    except OSError as exc:
        raise io_error(exc, what, f.path) from exc


def discard_flushing(f: Flushing) -> None:
    with contextlib.suppress(OSError):
        f.flushed.result()  # its descriptor is closed before the file goes
    unlink_quietly(f.path)


def store_full(where: Path, short: Space | None = None) -> SpoolError:
    """The error of a commit refused because the filesystem is (nearly) full: of bytes,
    or of inodes (``short``: its room, then)."""
    from ...errors import StoreIOError

    if short is not None:
        return StoreIOError(f"committing an entry refused: No space left on device: "
                            f"{no_inodes_detail(short)}; the last {short.inode_headroom} "
                            "are kept for maintenance", path=where, fix=INODE_FIX,
                            errno=errno.ENOSPC)

    return StoreIOError(f"committing an entry refused: No space left on device (less than "
                        f"{HEADROOM_BYTES >> 10} KiB free: that room is kept for maintenance)",
                        path=where,
                        fix="free disk space: `spoolctl clean --released` and lowering the "
                            "max size work on a full disk (docs/runbook.md)",
                        errno=errno.ENOSPC)


def existing_object_ok(path: Path, digest: str, size: int) -> bool:
    """True if the object already at ``path`` is a regular file with exactly this content
    (the one verification primitive: ``verify.verify_object``)."""
    try:
        verify_object(path, digest=digest, size=size)
    except (OSError, CorruptionError):
        return False
    return True
