"""Room to shed load on a full disk: the store's reserve file and the commit headroom.

A cache whose cleaner cannot run on a full disk turns a full disk into an outage: with
the filesystem at 100%, SQLite cannot even create its shared-memory file, so recording a
release, deleting released entries or evicting to a lowered max size would all fail with
ENOSPC. Two rules keep shedding possible (decision 1103):

* **A reserve file** ``state/reserve`` (``RESERVE_BYTES``, allocated up front) holds disk
  space for the store's own maintenance. An operation that *sheds* load (release, clean,
  eviction, orphan collection, lowering the max size, opening the catalog to do any of
  these) that fails for lack of space deletes the reserve and retries once. The reserve is
  re-created, best effort, when there is room again (next open, or after a shedding pass).
* **Commit headroom**: a commit refuses to start (StoreIOError, ENOSPC) while the
  filesystem has less than ``RESERVE_BYTES`` free, so the store's own writers never eat
  the space the reserve just gave back; they resume once maintenance (or the operator)
  has freed room.

So the disk a store may occupy is bounded by its max size, plus the entries in flight,
plus this reserve. Everything here is best effort: a filesystem that cannot hold the
reserve (smaller than it, or already full when the store is created) works as before.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

from .errors import StoreIOError
from .fsio import FILE_MODE, fsync_dir, full_fsync, tmp_name

RESERVE_NAME = "reserve"
RESERVE_BYTES = 1 << 20
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_no_space(exc: BaseException) -> bool:
    """True if ``exc`` (an OSError or the store's StoreIOError) means the disk is full."""
    if isinstance(exc, StoreIOError):
        return exc.errno in NO_SPACE
    return isinstance(exc, OSError) and exc.errno in NO_SPACE


class Reserve:
    """The reserve file of one store (``state/reserve``)."""

    def __init__(self, state_dir: Path, size: int = RESERVE_BYTES):
        self.path = state_dir / RESERVE_NAME
        self.size = size

    @property
    def present(self) -> bool:
        try:
            return os.lstat(self.path).st_size >= self.size
        except OSError:
            return False

    def ensure(self) -> bool:
        """Create the reserve if it is missing and the filesystem has room for it plus the
        commit headroom; True if it is in place afterwards. Never raises."""
        if self.present:
            return True
        try:
            if shutil.disk_usage(self.path.parent).free < 2 * self.size:
                return False
            tmp = self.path.with_name(f".{RESERVE_NAME}.{tmp_name()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                         FILE_MODE)
            try:
                _allocate(fd, self.size)
                full_fsync(fd)
            except OSError:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                return False
            os.close(fd)
            os.replace(tmp, self.path)
            fsync_dir(self.path.parent)
            return True
        except OSError:
            return False

    def release(self) -> bool:
        """Delete the reserve (its space goes back to the filesystem); True if there was one."""
        try:
            os.unlink(self.path)
        except OSError:
            return False
        with contextlib.suppress(OSError):
            fsync_dir(self.path.parent)
        return True


def _allocate(fd: int, size: int) -> None:
    """Really allocate ``size`` bytes (blocks, not a sparse hole)."""
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    block = b"\0" * (1 << 16)
    written = 0
    while written < size:
        written += os.write(fd, block[: min(len(block), size - written)])


def headroom_ok(directory: Path, need: int = RESERVE_BYTES) -> bool:
    """True if the filesystem of ``directory`` has at least ``need`` bytes free (or its
    free space cannot be read: then the write itself finds out)."""
    try:
        return shutil.disk_usage(directory).free >= need
    except OSError:
        return True
