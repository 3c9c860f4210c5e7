"""The hints a rebuild cannot read from the manifests, kept where it reads them:
``state/hints.log``.

The catalog is derived from the manifests, but an entry's retain/release hint is set after
its manifest is written (manifests are immutable), so a catalog rebuilt from the manifests
alone would retain every released entry again: the operator's releases gone, the next
``clean`` freeing nothing. So every hint change is also appended here, one line
``<hint> <entry id>`` per change, inside the catalog's write transaction (SQLite's write
lock orders the appends of every process as it orders their commits). A rebuild applies
the last hint of each entry whose manifest it finds, then writes the log afresh with only
the released entries; so does a writer when the log grows past its live content.

No fsync per append, like the catalog's own commits (``synchronous=NORMAL``): a process
crash loses nothing; a power cut may lose the last changes, as it may the catalog's. A torn
or foreign line is skipped. A rewrite is atomic (temp file, fsync, rename, fsync of
``state/``).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

from ..disk import dirfd
from ..disk.fsio import fsync_dir, write_tmp

NAME = "hints.log"
_LINE = re.compile(rb"(retain|release) ([0-9a-f]{64})")
# Bytes of one line: the log is rewritten when it holds this many times the lines its
# released entries need, and is larger than ``COMPACT_MIN`` at all.
LINE_BYTES = len(b"release ") + 64 + 1
COMPACT_FACTOR = 4
COMPACT_MIN = 1 << 20
# Written first, so the log holds its first block from the day it is made: the appends of a
# store on a disk kept full then go into that block and do not eat the store's reserve.
HEADER = b"# spoolctl hints log: one '<retain|release> <entry id>' line per change\n"


class HintLog:
    """``state/hints.log`` of one store (``path``); ``tmp``: where a rewrite drafts it."""

    def __init__(self, path: Path, tmp: Path):
        self.path = path
        self._tmp = tmp

    def append(self, changes: Iterable[tuple[str, str]]) -> None:
        """Append ``(entry id, hint)`` changes, in order, with one write."""
        data = b"".join(f"{hint} {entry_id}\n".encode() for entry_id, hint in changes
                        if hint in ("retain", "release"))
        if not data:
            return
        fd = dirfd.open_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def read(self) -> dict[str, str]:
        """The last hint of every entry the log names ({} without a log, or when it is not
        a regular file)."""
        try:
            fd = dirfd.open_file(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, OSError):
            return {}
        hints: dict[str, str] = {}
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return {}
            for line in f:
                if (m := _LINE.fullmatch(line.rstrip(b"\n"))) is not None:
                    hints[m.group(2).decode()] = m.group(1).decode()
        return hints

    def rewrite(self, released: Iterable[str]) -> None:
        """Replace the log, atomically, with one ``release`` line per id of ``released``."""
        data = b"".join(f"release {entry_id}\n".encode() for entry_id in released)
        tmp, _, _ = write_tmp(self._tmp, [HEADER, data])
        try:
            dirfd.replace(tmp, self.path)
        except BaseException:
            dirfd.unlink(tmp)
            raise
        fsync_dir(self.path.parent)

    def oversized(self, released: int) -> bool:
        """Whether the log holds far more than its ``released`` entries need."""
        try:
            size = dirfd.lstat(self.path).st_size
        except OSError:
            return False
        return size > COMPACT_MIN and size > COMPACT_FACTOR * LINE_BYTES * released
