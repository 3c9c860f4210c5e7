"""Room on the filesystem under a store: free bytes and free inodes.

A filesystem can refuse a new file (ENOSPC) with bytes to spare when it has no inode left,
and ``df -h`` then shows space: every no-space error names which of the two ran out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Commits stop while fewer inodes than this are free, so maintenance (SQLite's -wal/-shm
# files, quarantine reasons, the reserve) still finds some (1/64 of a small filesystem).
INODE_HEADROOM = 64
INODE_SHARE = 64
# Doctor warns below this share of the filesystem's inodes free.
INODE_WARN_RATIO = 0.05

INODE_FIX = ("free inodes: `spoolctl clean --released` (and `--capacity`) delete files and "
             "work with no inode free; a filesystem that runs out of inodes before bytes "
             "has too few for this store (tmpfs: nr_inodes=; ext4: mkfs -N or -i)")


@dataclass(frozen=True)
class Space:
    """Free room on one filesystem; ``inodes`` is None where it has no fixed inode count."""

    free_bytes: int
    total_bytes: int
    free_inodes: int | None
    inodes: int | None

    @property
    def inode_headroom(self) -> int:
        """Inodes kept for maintenance on this filesystem (commits stop below this)."""
        if self.inodes is None:
            return 0
        return max(1, min(INODE_HEADROOM, self.inodes // INODE_SHARE))

    @property
    def short_of_inodes(self) -> bool:
        """True if the filesystem is (nearly) out of inodes."""
        return self.free_inodes is not None and self.free_inodes < self.inode_headroom

    def to_json(self) -> dict[str, int | None]:
        return {"free_bytes": self.free_bytes, "total_bytes": self.total_bytes,
                "free_inodes": self.free_inodes, "inodes": self.inodes}


def space_of(path: str | os.PathLike[str]) -> Space | None:
    """The room on the filesystem holding ``path`` (or its nearest existing parent); None
    where it cannot be read (no statvfs, permission denied)."""
    current = Path(path)
    while True:
        try:
            st = os.statvfs(current)
            break
        except FileNotFoundError:
            if current.parent == current:
                return None
            current = current.parent
        except (OSError, AttributeError):
            return None
    frsize = st.f_frsize or st.f_bsize
    inodes = st.f_files if st.f_files > 0 else None
    return Space(free_bytes=st.f_bavail * frsize, total_bytes=st.f_blocks * frsize,
                 free_inodes=st.f_favail if inodes is not None else None, inodes=inodes)


def inodes_short(path: str | os.PathLike[str]) -> Space | None:
    """The filesystem's room if it is (nearly) out of inodes, else None."""
    space = space_of(path)
    return space if space is not None and space.short_of_inodes else None


def no_inodes_detail(space: Space) -> str:
    """The words a no-space message adds when inodes, not bytes, ran out."""
    return (f"no free inodes ({space.free_inodes} of {space.inodes} left, "
            f"{_size(space.free_bytes)} still free)")


def _size(n: int) -> str:
    from ..format.sizes import format_size

    return format_size(n)


def read_only_mount(path: Path) -> bool:
    """True if ``path`` is on a filesystem mounted read-only (statvfs ST_RDONLY)."""
    try:
        return bool(os.statvfs(path).f_flag & getattr(os, "ST_RDONLY", 1))
    except OSError:
        return False
