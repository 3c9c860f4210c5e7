"""Durable writes and safe reads of single files (the raw file I/O of the store; the
verification of an object, hash and check, is ``verify.py``).

Platform branches are small and named: ``full_fsync`` uses ``F_FULLFSYNC`` on
macOS (plain fsync there does not reach stable storage) and ``fsync``
elsewhere; ``O_NOFOLLOW`` guards every open inside the root.
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
# Unlinks are independent metadata operations that release the GIL; on filesystems where
# each one waits on the journal or an online discard (ext4 mounted with `discard`, common
# on VMs) a few in flight at once are an order of magnitude faster than one at a time.
# 16: a clean of 30k entries of a 1M-entry store took 7.1-7.5 s with 8, 6.7 s with 16 or
# 32, 12.9 s with 4 (scripts/bench_cli.py's store, 2 cores, ext4 with discard).
UNLINK_WORKERS = 16
UNLINK_POOL = LazyPool("spoolctl-unlink", UNLINK_WORKERS)
# Hashing on a helper thread, one chunk after another (BLAKE3 releases the GIL): the
# verified read's pipeline (``verify``) and a transient source's commit (below).
HASH_POOL = LazyPool("spoolctl-hash", 1)
# A plain payload of at least PLAIN_WRITEBACK_MIN bytes is written in WRITEBACK_PIECE pieces,
# each one's write-back started as it is written (decision 2951): one large write stalls in
# the kernel's dirty-page throttling while nothing is on its way to the disk. Smaller
# payloads (a 1 MiB ``put``, a group commit's entries) keep one write: there the extra
# calls cost more than they save (decision 2950).
PLAIN_WRITEBACK_MIN = 4 << 20
WRITEBACK_PIECE = 1 << 20


def full_fsync(fd: int) -> None:
    """Flush a file descriptor to stable storage (F_FULLFSYNC on macOS)."""
    if IS_DARWIN:
        import fcntl

        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass  # not supported by this filesystem: fall back to fsync
    os.fsync(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink inside ``path`` durable (opened by ``dirfd.open_dir``'s walk
    under a root another user owns)."""
    fd = dirfd.open_dir(path) if dirfd.guarded(path) else \
        os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        full_fsync(fd)
    finally:
        os.close(fd)


def precreate_private(path: Path) -> None:
    """Create ``path`` empty with mode 0600 if it does not exist (best effort).

    For SQLite databases: SQLite creates a new database 0644 (less the umask) and gives its
    -wal/-shm files the database's mode, so creating the file first keeps all three
    private. Any error is left for SQLite's own open to report.
    """
    with contextlib.suppress(OSError):
        os.close(dirfd.open_file(path, os.O_WRONLY | os.O_CREAT, FILE_MODE))


def ensure_real_dirs(root: Path, directory: Path) -> None:
    """Raise OSError(ELOOP) unless ``root`` and every directory from it down to
    ``directory`` is a real directory, not a symlink (ValueError if ``directory`` is not
    under ``root``).

    Called just before each write into the store, so a directory swapped for a link
    *after* the store was opened (TOCTOU) never redirects a write outside the root.
    This narrows the race to the moment between this check and the write; dir-fd based
    I/O (openat) would close it completely (docs/SECURITY.md). Works on strings, not
    ``pathlib``: a group commit calls it several times per entry.
    """
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
    """A unique in-flight file name that records the writer's pid (for abandonment checks):
    ``<pid>-<16 hex>.part``; ``tmp_writer`` reads it back."""
    return f"{os.getpid()}-{secrets.token_hex(8)}.part"


# The one parser of ``tmp_name``'s names. ASCII digits only; a pid is a positive C int.
_TMP_NAME_RE = re.compile(r"([0-9]{1,10})-[0-9a-f]{16}\.part")
_PID_MAX = (1 << 31) - 1


def tmp_writer(name: str) -> int | None:
    """The pid of the process that made temp file ``name`` (``tmp_name``), or None if
    spoolctl did not make a file of that name (or its pid cannot be one: no process check
    may be asked about it)."""
    m = _TMP_NAME_RE.fullmatch(name)
    if m is None:
        return None
    pid = int(m.group(1))
    return pid if 0 < pid <= _PID_MAX else None


def io_error(exc: OSError, what: str, path: Path) -> StoreIOError:
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
        # bytes free, inodes not: `df -h` shows space, so say which ran out (issue 30.2)
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
    them on the way, fsync, and return ``(tmp_path, digest, size)``.

    ``on_written`` is called once the bytes are written, before the fsync (a crash-test
    checkpoint). ``limit``: once more than this many bytes arrived, stop and raise
    SizeLimitExceeded (a streamed payload is bounded while it streams, not after). On any
    error the partial file is removed; an OS error is raised as StoreIOError, a chunk
    that is not bytes-like as TypeError.
    """
    tmp = write_tmp_flushing(tmp_dir, chunks, on_written=on_written, limit=limit)
    try:
        tmp.flushed.result()
    except OSError as exc:
        unlink_quietly(tmp.path)
        raise io_error(exc, "writing", tmp.path) from exc
    return tmp.path, tmp.digest, tmp.size


class Flushing:
    """A temp file written and hashed whose flush to disk may still be running.

    ``flushed`` completes (or raises the OSError of the fsync) once the bytes are durable;
    its descriptor is closed by then either way. The caller owns ``path``: it removes it
    if the flush failed or the file is not used."""

    __slots__ = ("digest", "flushed", "path", "size")

    def __init__(self, path: Path, digest: str, size: int, flushed: Future[None]):
        self.path, self.digest, self.size, self.flushed = path, digest, size, flushed


class TmpFile:
    """A new, empty temp file and its open descriptor (``create_tmp``), not yet written.

    Whoever holds it writes it (``write_tmp_flushing(..., into=)``, which then owns it) or
    gives it up with ``discard``."""

    __slots__ = ("fd", "path")

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    def discard(self) -> None:
        """Close and remove the file (best effort: it was never written)."""
        with contextlib.suppress(OSError):
            os.close(self.fd)
        unlink_quietly(self.path)


def create_tmp(tmp_dir: Path, dirs: DirFds | None = None) -> TmpFile:
    """Create a new temp file in ``tmp_dir`` (O_EXCL|O_NOFOLLOW, 0600), through the
    directory's descriptor (from ``dirs`` when given, else opened for this file: never
    through a ``tmp/`` swapped for a link, issue 35.1); StoreIOError if it cannot be
    created.

    A group commit creates its files ahead, several together before any of their flushes
    starts: on ext4 a file created while a journal commit is in flight waits for it (64
    files: 6 ms created between flushes, 2 ms together; decision 1408)."""
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
    a helper thread, hash the bytes on this one while it runs, and return.

    A group commit stages many files this way, so their flushes overlap each other (and
    the next writes) and the filesystem can merge them into a few journal commits. The
    chunks are kept referenced until hashed. ``into``: a file ``create_tmp`` made ahead,
    written instead of a new one (and owned from here on, also on error). ``dirs``: see
    ``create_tmp``. Errors as for ``write_tmp``; a failed flush is reported by
    ``Flushing.flushed``.

    Early write-back (only starts what the fsync would do; durability is the fsync's): a
    transient source's pieces each as written (decision 2830); a plain payload once the
    chunks so far reach ``PLAIN_WRITEBACK_MIN``, written in ``WRITEBACK_PIECE`` pieces
    (decision 2951). Below that, one write per chunk and nothing started early.
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
                        start_writeback(fd, started, size - started)  # decision 2951
                        started = size
                if transient:  # the chunk before this one is hashed before its buffer is reused
                    # start this piece's write-back now, while the next one is encrypted,
                    # so the fsync below finds little left to write (decision 2830)
                    start_writeback(fd, size - len(whole), len(whole))
                    if hashing is not None:
                        hashing, done = None, hashing
                        done.result()
                    hashing = HASH_POOL.submit(hasher.update, whole)
            if hashing is not None:
                hashing, done = None, hashing
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
    """Start writing ``length`` bytes of ``fd`` at ``offset`` from the page cache to the disk
    without waiting for them (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so that a
    later fsync has little left to do. Durability is unchanged: only the fsync promises
    anything. Best effort: nothing where the call does not exist or the filesystem refuses."""
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
    """Remove ``path`` if it can be removed (cleanup on a path already failing), through
    its directory's descriptor (``dirfd.unlink``).

    A commit calls this for every temp file of its batch, most of them renamed already:
    one ``lstat`` tells those apart before the walk from / (the check only decides whether
    to try; the unlink itself never resolves the path)."""
    if not os.path.lexists(path):
        return
    with contextlib.suppress(OSError):
        dirfd.unlink(path)


class SpecialFileError(OSError):
    """A store path is not a regular file (a FIFO, socket, device or directory).

    Raised instead of opening it for I/O: reading a FIFO would block forever, and no
    spoolctl process ever creates anything but regular files in a store."""

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


def open_regular(path: Path, flags: int = os.O_RDONLY, mode: int = FILE_MODE) -> int:
    """Open a store file without ever blocking and only if it is a regular file.

    ``O_NONBLOCK`` makes the open of a FIFO return at once (a plain open for reading
    waits for a writer forever), ``O_NOFOLLOW`` refuses a symlink at the last component,
    and ``fstat`` on the descriptor refuses anything that is not a regular file with
    ``SpecialFileError``. The descriptor is switched back to blocking mode (which regular
    files ignore anyway)."""
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


def open_for_read(path: Path) -> int:
    """Open a store file for reading: no symlink at its last component, never blocks,
    regular files only (``open_regular``)."""
    return open_regular(path)


def read_small(path: Path, limit: int) -> bytes:
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


# Errors of the disk or the mount rather than of the file (a failing sector, a hung or
# vanished network/FUSE mount): proof of nothing about the bytes, so a read that meets one
# is a miss and a finding, never a quarantine (decision 2700).
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


def read_manifest_sized(path: Path, entry_id: str) -> tuple[Manifest, int]:
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


def flush_submit(fn: Callable[..., Any], *args: Any) -> Future:
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
    (so a directory swapped for a symlink after it was opened is never followed; the
    caller keeps ``dirs`` open until the results are consumed); yield, in order, each
    one's outcome (True: deleted, False: already gone, or the OSError that kept it).

    One system call per file, no stat: sizes come from the catalog, and an unlink that
    waits on the filesystem's journal should not wait twice. Results are yielded as they
    complete in order, so a caller can mark a checkpoint after each; other unlinks may
    already be in flight at that moment.
    """
    if len(paths) < 2 * UNLINK_WORKERS:
        return (_unlink(p, dirs) for p in paths)
    return UNLINK_POOL.map(_unlink, paths, itertools.repeat(dirs))
