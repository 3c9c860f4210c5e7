"""Durable writes and safe reads of single store files (object verification is ``verify``).

``O_NOFOLLOW`` guards every open inside the root.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import os
import re
import secrets
import stat
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ...errors import ManifestError, QuarantineReason, StoreIOError
from ..format.digest import Hasher
from ..format.manifest import MAX_MANIFEST_BYTES, Manifest, decode
from . import dirfd
from .dirfd import DirFds
from .pools import LazyPool
from .space import INODE_FIX, inodes_short, no_inodes_detail

IS_DARWIN = sys.platform == "darwin"
FILE_MODE = 0o600
DIR_MODE = 0o700
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
# fsyncs in flight at once: concurrent flushes of many files (a group commit) are merged by
# the filesystem into few journal commits; each thread mostly waits on the disk.
FLUSH_WORKERS = 16
FLUSH_POOL = LazyPool("spoolctl-fsync", FLUSH_WORKERS)
# Unlinks in flight at once: where each waits on the journal or an online discard, a few
# together are an order of magnitude faster than one at a time.
UNLINK_WORKERS = 16
UNLINK_POOL = LazyPool("spoolctl-unlink", UNLINK_WORKERS)
# Hashing on a helper thread, one chunk after another (BLAKE3 releases the GIL): the
# verified read's pipeline (``verify``) and a transient source's commit (below).
HASH_POOL = LazyPool("spoolctl-hash", 1)
# A plain payload of at least PLAIN_WRITEBACK_MIN bytes is written in WRITEBACK_PIECE pieces,
# each one's write-back started as written: one large write stalls in dirty-page throttling
# with nothing on its way to disk. Smaller payloads keep one write (extra calls cost more).
PLAIN_WRITEBACK_MIN = 4 << 20
WRITEBACK_PIECE = 1 << 20


def full_fsync(fd: int) -> None:
    """Flush a file descriptor to stable storage."""
    if sys.platform == "darwin":  # plain fsync there does not reach stable storage
        import fcntl

        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass  # not supported by this filesystem: fall back to fsync
    os.fsync(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink inside ``path`` durable."""
    fd = dirfd.open_dir(path) if dirfd.guarded(path) else \
        os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        full_fsync(fd)
    finally:
        os.close(fd)


def precreate_private(path: Path) -> None:
    """Create ``path`` empty with mode 0600 if it does not exist (best effort; errors are
    left for the next open to report). SQLite gives -wal/-shm the database's mode, so a
    database created this way keeps all three private."""
    with contextlib.suppress(OSError):
        os.close(dirfd.open_file(path, os.O_WRONLY | os.O_CREAT, FILE_MODE))


def ensure_real_dirs(root: Path, directory: Path) -> None:
    """Raise OSError(ELOOP) unless ``root`` and every directory from it down to
    ``directory`` is a real directory, not a symlink; ValueError if ``directory`` is not
    under ``root``. Strings, not ``pathlib``: a group commit calls it per entry."""
    top, below = os.fspath(root), os.fspath(directory)
    if below != top:
        prefix = top if top.endswith(os.sep) else top + os.sep
        if not below.startswith(prefix):
            raise ValueError(f"{below!r} is not under {top!r}")
    current = top
    _check_real_dir(current)
    for part in below[len(top):].split(os.sep):
        if part:
            current = os.path.join(current, part)
            _check_real_dir(current)


def _check_real_dir(path: str) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ELOOP, "store directory replaced by a symlink or file", path)


def describe_os_error(exc: OSError) -> str:
    """The reason of an OSError in a few words, without the path (callers name it once)."""
    if isinstance(exc, SpecialFileError):
        return exc.strerror or "not a regular file"
    return os.strerror(exc.errno) if exc.errno else (exc.strerror or type(exc).__name__)


def tmp_name() -> str:
    """A unique temp file name ``<pid>-<16 hex>.part`` (the pid: for abandonment checks)."""
    return f"{os.getpid()}-{secrets.token_hex(8)}.part"


# The one parser of ``tmp_name``'s names. ASCII digits only; a pid is a positive C int.
_TMP_NAME_RE = re.compile(r"([0-9]{1,10})-[0-9a-f]{16}\.part")
_PID_MAX = (1 << 31) - 1


def tmp_writer(name: str) -> int | None:
    """The writer pid in a ``tmp_name`` name, or None if ``name`` is not one or its pid
    is out of range."""
    m = _TMP_NAME_RE.fullmatch(name)
    if m is None:
        return None
    pid = int(m.group(1))
    return pid if 0 < pid <= _PID_MAX else None


def io_error(exc: OSError, what: str, path: Path | str) -> StoreIOError:
    fix = {
        errno.ENOSPC: "free disk space: `spoolctl clean --released` and lowering the max size "
                      "work on a full disk (docs/runbook.md)",
        errno.EDQUOT: "raise the disk quota, or shed entries: `spoolctl clean --released`",
        errno.EROFS: "remount the filesystem read-write",
        errno.EACCES: "check the store's owner and permissions (`spoolctl doctor`)",
        errno.ELOOP: "a store directory was swapped for a symlink: inspect the store "
                     "before using it again",
    }.get(exc.errno or 0, "check the disk (`spoolctl doctor`, dmesg)")
    reason = describe_os_error(exc)
    if exc.errno == errno.ENOSPC and (short := inodes_short(path)) is not None:
        # bytes free, inodes not: `df -h` shows space, so say which ran out
        reason, fix = f"{reason}: {no_inodes_detail(short)}", INODE_FIX
    return StoreIOError(f"{what} failed: {reason}", path=path, fix=fix, errno=exc.errno)


class SizeLimitExceeded(Exception):
    """A streamed payload grew past the ``limit`` given to ``write_tmp`` (nothing kept)."""

    def __init__(self, limit: int):
        super().__init__(f"payload larger than {limit} bytes")
        self.limit = limit


def write_tmp(
    tmp_dir: Path, chunks: Iterable[bytes | bytearray | memoryview], *,
    on_written: Callable[[], None] | None = None, limit: int | None = None,
) -> tuple[Path, str, int]:
    """Write ``chunks`` to a new file in ``tmp_dir`` (O_EXCL|O_NOFOLLOW, 0600), hash
    them, fsync, and return ``(tmp_path, digest, size)``.

    ``on_written``: called after the write, before the fsync. ``limit``: more bytes than
    this raise SizeLimitExceeded. On any error the partial file is removed; OS errors are
    raised as StoreIOError, a chunk that is not bytes-like as TypeError.
    """
    tmp = write_tmp_flushing(tmp_dir, chunks, on_written=on_written, limit=limit)
    try:
        tmp.flushed.result()
    except OSError as exc:
        unlink_quietly(tmp.path)
        raise io_error(exc, "writing", tmp.path) from exc
    return tmp.path, tmp.digest, tmp.size


class Flushing:
    """A temp file written and hashed whose flush may still be running.

    ``flushed`` completes (or raises the fsync's OSError) once the bytes are durable, the
    descriptor closed either way. The caller owns ``path`` and removes it if unused."""

    __slots__ = ("digest", "flushed", "path", "size")

    def __init__(self, path: Path, digest: str, size: int, flushed: Future[None]):
        self.path, self.digest, self.size, self.flushed = path, digest, size, flushed


class TmpFile:
    """A new, empty temp file and its open descriptor: written by
    ``write_tmp_flushing(..., into=)`` (which then owns it) or given up with ``discard``."""

    __slots__ = ("fd", "path")

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    def discard(self) -> None:
        """Close and remove the file (best effort: it was never written)."""
        with contextlib.suppress(OSError):
            os.close(self.fd)
        unlink_quietly(self.path)


def create_tmp(tmp_dir: Path, dirs: DirFds | None = None) -> TmpFile:
    """Create a new temp file in ``tmp_dir`` (O_EXCL|O_NOFOLLOW, 0600) through the
    directory's descriptor (from ``dirs``, else opened now), so a ``tmp/`` swapped for a
    link is never followed. StoreIOError if it cannot be created."""
    name = tmp_name()
    path = tmp_dir / name
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
    try:
        if dirs is None:
            return TmpFile(path, dirfd.create(path, flags, FILE_MODE))
        return TmpFile(path, dirfd.open_at(dirs.fd(tmp_dir), name, flags, FILE_MODE, path))
    except OSError as exc:
        raise io_error(exc, "creating a temporary file", path) from exc


def write_tmp_flushing(
    tmp_dir: Path, chunks: Iterable[bytes | bytearray | memoryview], *,
    on_written: Callable[[], None] | None = None, limit: int | None = None,
    into: TmpFile | None = None, dirs: DirFds | None = None,
) -> Flushing:
    """``write_tmp`` without waiting for the fsync: write ``chunks``, start the flush on
    a helper thread, hash the bytes meanwhile, and return.

    ``into``: a file from ``create_tmp`` to write instead of a new one (owned from here on,
    also on error). ``dirs``: see ``create_tmp``. Errors as for ``write_tmp``; a failed
    flush is raised by ``Flushing.flushed``.
    """
    tmp = create_tmp(tmp_dir, dirs) if into is None else into
    path, fd = tmp.path, tmp.fd
    hasher = Hasher()
    size = 0
    flushed: Future[None] | None = None
    # A ``transient`` source reuses its buffers: a chunk stays valid only until the one
    # after next is asked for (``sealing.SealedStream``, two buffers in turn). Its chunks
    # are hashed as they are written, each on the hash pool while the source makes the
    # next one (both in the CPU cache); others are hashed while the flush runs (below).
    transient = getattr(chunks, "transient", False)
    hashing: Future[None] | None = None
    # A plain payload once it reaches PLAIN_WRITEBACK_MIN (known from the chunks so far):
    # written in pieces, the write-back of everything before ``started`` already begun.
    early, started = False, 0
    try:
        try:
            views = []
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                whole = view
                if not transient:
                    views.append(view)
                if limit is not None and size + len(view) > limit:
                    raise SizeLimitExceeded(limit)
                early = early or (not transient and size + len(view) >= PLAIN_WRITEBACK_MIN)
                step = WRITEBACK_PIECE if early else len(view)
                while view:
                    n = os.write(fd, view[:step])
                    size += n
                    view = view[n:]
                    if early and size - started >= WRITEBACK_PIECE:
                        start_writeback(fd, started, size - started)
                        started = size
                if transient:  # the chunk before this one is hashed before its buffer is reused
                    # start this piece's write-back now, while the next one is encrypted,
                    # so the fsync below finds little left to write
                    start_writeback(fd, size - len(whole), len(whole))
                    if hashing is not None:
                        done, hashing = hashing, None
                        done.result()
                    hashing = HASH_POOL.submit(hasher.update, whole)
            if hashing is not None:
                done, hashing = hashing, None
                done.result()
            if on_written is not None:
                on_written()
            # The bytes are in the page cache: flush them to disk on a helper thread while
            # this thread hashes them, so a commit costs about write + max(fsync, hash).
            flushed = FLUSH_POOL.submit(fsync_close, fd)
            for view in views:
                hasher.update(view)
        finally:
            if hashing is not None:  # never leave the helper reading the source's buffer
                with contextlib.suppress(Exception):
                    hashing.result()
            if flushed is None:
                os.close(fd)
    except OSError as exc:
        unlink_quietly(path)
        raise io_error(exc, "writing", path) from exc
    except BaseException:
        if flushed is not None:
            with contextlib.suppress(OSError):
                flushed.result()  # the descriptor must be closed before the file goes
        unlink_quietly(path)
        raise
    return Flushing(path, hasher.hexdigest(), size, flushed)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``length`` bytes of ``fd`` at ``offset`` to disk without waiting
    (Linux ``sync_file_range``), so a later fsync has little left. Best effort."""
    call = _sync_file_range()
    if call is not None:
        call(fd, offset, length, _SFR_WRITE)  # an error is ignored: the fsync reports it


_SFR_WRITE = 2  # SYNC_FILE_RANGE_WRITE (linux/fs.h); Python's os module has no binding


@functools.cache
def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` through ctypes (the call releases the GIL), or None
    off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    call.restype = ctypes.c_int
    return call


def fsync_close(fd: int) -> None:
    """fsync ``fd`` (``full_fsync``), then close it whatever happened."""
    try:
        full_fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: Path) -> None:
    """Remove ``path`` through its directory's descriptor if it can be (errors ignored).
    One ``lstat`` first skips the common case of a file already renamed away."""
    if not os.path.lexists(path):
        return
    with contextlib.suppress(OSError):
        dirfd.unlink(path)


class SpecialFileError(OSError):
    """A store path is not a regular file (a FIFO, socket, device or directory)."""

    def __init__(self, path: Path | str, mode: int):
        super().__init__(errno.EINVAL, f"not a regular file ({file_kind(mode)})", str(path))
        self.kind = file_kind(mode)


def file_kind(mode: int) -> str:
    """``fifo``, ``socket``, ``directory``... for an ``st_mode`` (for messages)."""
    for test, name in ((stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISREG, "regular file")):
        if test(mode):
            return name
    return "special file"


def open_regular(path: Path | str, flags: int = os.O_RDONLY, mode: int = FILE_MODE) -> int:
    """Open a store file, never following a link and never blocking (O_NONBLOCK: a FIFO
    would wait for a writer forever); SpecialFileError unless it is a regular file.
    Returns a blocking descriptor."""
    fd = dirfd.open_file(path, flags | _O_NONBLOCK, mode)  # no link followed on the way
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SpecialFileError(path, st.st_mode)
        if _O_NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_for_read(path: Path | str) -> int:
    """Open a store file for reading: no symlink at its last component, never blocks,
    regular files only (``open_regular``)."""
    return open_regular(path)


def read_small(path: Path | str, limit: int) -> bytes:
    """Read a whole small file (manifest, marker, reason) without following symlinks;
    at most ``limit + 1`` bytes, so a caller can tell an oversized file."""
    fd = open_for_read(path)
    try:
        parts, left = [], limit + 1
        while left > 0:  # a regular file reads whole unless a signal cuts a read short
            part = os.read(fd, left)
            if not part:
                break
            parts.append(part)
            left -= len(part)
    finally:
        os.close(fd)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def in_page_cache(path: str) -> bool | None:
    """True if the first byte of ``path`` can be read without waiting for the disk, False
    if it cannot, None if that cannot be told here (no ``RWF_NOWAIT``) or the file cannot
    be opened. Never follows a symlink, never blocks on a FIFO."""
    nowait = getattr(os, "RWF_NOWAIT", None)
    if nowait is None or not hasattr(os, "preadv") or (fd := _peek_open(path)) is None:
        return None
    try:
        os.preadv(fd, [bytearray(1)], 0, nowait)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None
    finally:
        os.close(fd)


def prefetch(path: str) -> None:
    """Ask the kernel to start reading ``path`` into the page cache and return without
    waiting for it (``POSIX_FADV_WILLNEED``; nothing where the platform has no fadvise).
    Never follows a symlink and never blocks on a FIFO; errors are ignored: the real read
    that follows reports them."""
    if not hasattr(os, "posix_fadvise") or (fd := _peek_open(path)) is None:
        return
    try:
        advise_willneed(fd)
    finally:
        os.close(fd)


def _peek_open(path: str) -> int | None:
    """A read-only descriptor of ``path`` for a hint to the kernel, or None if it cannot be
    opened (never follows a symlink, never blocks on a FIFO)."""
    try:
        return dirfd.open_file(path, os.O_RDONLY | _O_NONBLOCK)
    except OSError:
        return None


# Errors of the disk or the mount, not of the file: they prove nothing about the bytes, so
# a read that meets one is a miss and a finding, never a quarantine.
DISK_ERRNOS = frozenset(e for e in (errno.EIO, errno.ETIMEDOUT, errno.ENOTCONN, errno.ESTALE,
                                    errno.ENXIO, errno.ENODEV,
                                    getattr(errno, "EREMOTEIO", None)) if e is not None)


def read_manifest(path: Path, entry_id: str) -> Manifest:
    """Read and decode the manifest file of ``entry_id`` at ``path`` (bounded, no symlinks).

    Raises FileNotFoundError if there is none, StoreIOError if the disk failed under the
    read (``DISK_ERRNOS``), ManifestError if it is unreadable otherwise or does not validate
    (including a manifest that belongs to another entry id).
    """
    return read_manifest_sized(path, entry_id)[0]


def read_manifest_sized(path: Path | str, entry_id: str) -> tuple[Manifest, int]:
    """``read_manifest`` and the size of the file it read (what the catalog records)."""
    try:
        data = read_small(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise FileNotFoundError(path) from None
        if exc.errno in DISK_ERRNOS:  # the disk failed, not the file: a miss, no quarantine
            raise io_error(exc, "reading a manifest", path) from None
        raise ManifestError(f"manifest unreadable: {describe_os_error(exc)}",
                            reason=QuarantineReason.MANIFEST_IO, path=path,
                            entry_id=entry_id) from None
    return decode(data, expected_entry_id=entry_id, path=str(path)), len(data)


def flush_submit(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """``fn(*args)`` on the shared pool that runs fsyncs (of files and directories) off the
    calling thread; on the calling thread at interpreter exit (``pools.LazyPool``)."""
    return FLUSH_POOL.submit(fn, *args)


def advise_willneed(fd: int) -> None:
    """Start reading all of ``fd`` into the page cache (best effort; not everywhere)."""
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)


def probe_o_direct(directory: Path) -> bool:
    """True if files in ``directory`` can be opened with O_DIRECT (Linux only)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    path = directory / f".odirect-probe-{tmp_name()}"
    try:  # through the directory's descriptor: a swapped directory is refused (ELOOP)
        fd = dirfd.create(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flag, FILE_MODE)
    except OSError:
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        dirfd.unlink(path)
    return True


def _unlink(path: Path, dirs: DirFds) -> bool | OSError:
    """Unlink ``path`` through its directory's descriptor in ``dirs``; True if it was
    deleted, False if it was already gone, or the OSError that kept it (EACCES, EROFS,
    ELOOP for a directory swapped for a symlink...: the caller reports it and moves on)."""
    try:
        dirs.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        return exc
    return True


def unlink_many(paths: list[Path], dirs: DirFds) -> Iterable[bool | OSError]:
    """Unlink ``paths`` concurrently, each through its directory's descriptor in ``dirs``
    (kept open by the caller until the results are consumed); yield each outcome in order
    (True: deleted, False: already gone, or the OSError that kept it). No stat."""
    if len(paths) < 2 * UNLINK_WORKERS:
        return (_unlink(p, dirs) for p in paths)
    return UNLINK_POOL.map(_unlink, paths, itertools.repeat(dirs))
