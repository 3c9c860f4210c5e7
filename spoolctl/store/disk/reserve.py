"""Room to shed load on a full disk: the store's reserve file and the commit headroom.

On a full disk SQLite cannot even create its shared-memory file, so shedding load (release,
clean, eviction) would fail with ENOSPC. Two rules keep it possible:

* **A reserve** of up to ``PIECES`` preallocated files ``state/reserve.<n>`` (at most 1/64
  of the filesystem): a shedding operation that fails for lack of space deletes one piece
  and retries; missing pieces are re-created after each shedding operation and at open.
* **Commit headroom**: a commit refuses to start while less than ``HEADROOM_BYTES`` are
  free, so the store's writers never take the room a piece gave back.

Best effort: a filesystem that cannot hold the reserve works with fewer pieces or none.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

from ...errors import StoreIOError
from . import dirfd
from .fsio import FILE_MODE, fsync_dir, full_fsync, tmp_name

RESERVE_NAME = "reserve"
PIECES = 16
PIECE_BYTES = 64 << 10
RESERVE_BYTES = PIECES * PIECE_BYTES
HEADROOM_BYTES = 128 << 10
FS_SHARE = 64  # the reserve (and the headroom) take at most 1/64 of the filesystem
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_no_space(exc: BaseException) -> bool:
    """True if ``exc`` (an OSError or the store's StoreIOError) means the disk is full."""
    if isinstance(exc, StoreIOError):
        return exc.errno in NO_SPACE
    return isinstance(exc, OSError) and exc.errno in NO_SPACE


class Reserve:
    """The reserve of one store: ``state/reserve.0`` ... ``state/reserve.<PIECES-1>``."""

    def __init__(self, state_dir: Path, pieces: int = PIECES, piece_bytes: int = PIECE_BYTES):
        self.state_dir = state_dir
        self.most = pieces
        self.piece_bytes = piece_bytes

    @property
    def pieces(self) -> int:
        """How many pieces this filesystem gets: 1/64 of its size, at most ``PIECES``."""
        try:
            total = shutil.disk_usage(self.state_dir).total
        except OSError:
            return self.most
        return min(self.most, total // (FS_SHARE * self.piece_bytes))

    @property
    def size(self) -> int:
        return self.pieces * self.piece_bytes

    def _path(self, n: int) -> Path:
        return self.state_dir / f"{RESERVE_NAME}.{n}"

    def _present(self, n: int) -> bool:
        try:
            return dirfd.lstat(self._path(n)).st_size >= self.piece_bytes
        except OSError:
            return False

    @property
    def count(self) -> int:
        """How many pieces are in place."""
        return sum(self._present(n) for n in range(self.most))

    @property
    def present(self) -> bool:
        return self.count >= self.pieces

    def ensure(self) -> int:
        """Create the missing pieces while the filesystem has room for them; return how
        many pieces are in place afterwards. Never raises."""
        for n in range(self.pieces):
            if not self._present(n) and not self._create(n):
                break
        return self.count

    def _create(self, n: int) -> bool:
        try:
            if shutil.disk_usage(self.state_dir).free < self.piece_bytes:
                return False
            tmp = self.state_dir / f".{RESERVE_NAME}.{tmp_name()}"
            fd = dirfd.create(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            try:
                _allocate(fd, self.piece_bytes)
                full_fsync(fd)
            except OSError:
                os.close(fd)
                with contextlib.suppress(OSError):
                    dirfd.unlink(tmp)
                return False
            os.close(fd)
            dirfd.replace(tmp, self._path(n))
            fsync_dir(self.state_dir)
            return True
        except OSError:
            return False

    def release(self) -> bool:
        """Delete one piece (its space goes back to the filesystem); True if there was one."""
        for n in reversed(range(self.most)):
            try:
                dirfd.unlink(self._path(n))
            except FileNotFoundError:
                continue
            except OSError:
                return False
            with contextlib.suppress(OSError):
                fsync_dir(self.state_dir)
            return True
        return False


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


def headroom_ok(directory: Path, need: int = HEADROOM_BYTES) -> bool:
    """True if the filesystem of ``directory`` has at least ``need`` bytes free (1/64 of a
    small filesystem), or its free space cannot be read (then the write finds out)."""
    try:
        usage = shutil.disk_usage(directory)
    except OSError:
        return True
    return usage.free >= min(need, usage.total // FS_SHARE)
