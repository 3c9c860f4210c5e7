"""Making files visible in the store durably: the one copy of write-temp / fsync / rename /
fsync-directory.

Three steps, each its own method so a group commit can run one step for many files and
fsync each directory once: ``stage`` (write, hash and fsync a temp file), ``place``
(rename it to its final path, no symlinked directory on the way), ``sync`` (fsync each
parent directory once). ``publish`` is steps 2 and 3 for one file. With ``what`` given,
each step passes the crash checkpoint ``<what>.tmp_written`` / ``.fsynced`` /
``.published`` / ``.dir_fsynced``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from . import dirfd
from .fsio import (
    Flushing,
    TmpFile,
    create_tmp,
    ensure_real_dirs,
    fsync_dir,
    io_error,
    write_tmp,
    write_tmp_flushing,
)

Chunks = Iterable[bytes | bytearray | memoryview]


@dataclass(frozen=True)
class Staged:
    """A durable temp file: written, hashed and fsynced, not yet visible."""

    tmp: Path
    digest: str
    size: int


class Publisher:
    """Publishes files under ``root`` through temp files in ``tmp_dir``."""

    def __init__(self, root: Path, tmp_dir: Path, checkpoint: Callable[[str], None]):
        self.root = root
        self.tmp_dir = tmp_dir
        self._checkpoint = checkpoint
        self._local = threading.local()  # this thread's batch (``batch``)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Inside, this thread's creates and renames reuse one descriptor per directory,
        closed when the batch ends. Nests."""
        if getattr(self._local, "dirs", None) is not None:
            yield
            return
        with dirfd.DirFds() as dirs:
            self._local.dirs = dirs
            try:
                yield
            finally:
                self._local.dirs = None

    def _dirs(self) -> dirfd.DirFds | None:
        return getattr(self._local, "dirs", None)

    def mark(self, what: str | None, step: str) -> None:
        """Pass the crash checkpoint ``<what>.<step>`` (nothing when ``what`` is None)."""
        if what is not None:
            self._checkpoint(f"{what}.{step}")

    def stage(self, chunks: Chunks, *, what: str | None, limit: int | None = None) -> Staged:
        """Step 1: write ``chunks`` to a temp file, hash and fsync it.

        Raises StoreIOError (nothing left behind) if the disk fails, SizeLimitExceeded if
        more than ``limit`` bytes arrive, TypeError for a chunk that is not bytes-like.
        """
        tmp, digest, size = write_tmp(self.tmp_dir, chunks, limit=limit,
                                      on_written=lambda: self.mark(what, "tmp_written"))
        staged = Staged(tmp, digest, size)
        with self.failing(staged, "writing", tmp):
            self.mark(what, "fsynced")
        return staged

    def create_tmp(self) -> TmpFile:
        """A new empty temp file, to be written by ``stage_flushing(..., into=)``.
        StoreIOError if it cannot be created."""
        return create_tmp(self.tmp_dir, self._dirs())

    def stage_flushing(self, chunks: Chunks, *, what: str | None,
                       limit: int | None = None, into: TmpFile | None = None) -> Flushing:
        """Step 1 without waiting for the fsync (``Flushing.flushed``), into ``into`` or a
        new temp file. The caller passes ``<what>.fsynced`` once it has waited, and removes
        the file if it is not published. Errors as for ``stage``."""
        return write_tmp_flushing(self.tmp_dir, chunks, limit=limit, into=into,
                                  on_written=lambda: self.mark(what, "tmp_written"),
                                  dirs=self._dirs())

    def check_dirs(self, directory: Path) -> None:
        """Raise OSError(ELOOP) unless every directory from the root to ``directory`` is
        a real directory (call before looking at or writing a final path)."""
        ensure_real_dirs(self.root, directory)

    def place(self, src: Path, final: Path, *, what: str | None,
              placed: list[Path] | None = None, checked: bool = False) -> None:
        """Step 2: rename ``src`` to ``final`` (atomic; replaces what is there).

        ``final`` is appended to ``placed`` as soon as it is visible. ``checked``: the caller
        ran ``check_dirs(final.parent)`` just before.
        """
        if not checked:
            ensure_real_dirs(self.root, final.parent)
        dirs = self._dirs()
        if dirs is None:
            dirfd.replace(src, final)
        else:  # both names resolved in directories opened without following a link
            os.replace(src.name, final.name, src_dir_fd=dirs.fd(src.parent),
                       dst_dir_fd=dirs.fd(final.parent))
        if placed is not None:
            placed.append(final)
        self.mark(what, "published")

    def sync(self, directories: Iterable[Path], *, what: str | None) -> None:
        """Step 3: fsync each directory once, making the renames into it durable."""
        for directory in dict.fromkeys(directories):
            fsync_dir(directory)
            self.mark(what, "dir_fsynced")

    def publish(self, src: Path, final: Path, *, what: str | None,
                placed: list[Path] | None = None) -> None:
        """Steps 2 and 3 for one file (``placed``: see ``place``)."""
        self.place(src, final, what=what, placed=placed)
        self.sync([final.parent], what=what)

    @staticmethod
    def discard(staged: Staged) -> None:
        """Remove a staged temp file that will not be published (best effort)."""
        with contextlib.suppress(OSError):
            dirfd.unlink(staged.tmp)

    @contextlib.contextmanager
    def failing(self, staged: Staged, what: str, path: Path) -> Iterator[None]:
        """On OSError in the block: discard ``staged`` and raise StoreIOError for ``what``
        at ``path`` (a staged file already renamed is not touched: its name is unique)."""
        try:
            yield
        except OSError as exc:
            self.discard(staged)
            raise io_error(exc, what, path) from exc
