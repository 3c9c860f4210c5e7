"""Durable writes and verified reads of single files (the only raw file I/O of the store).

Platform branches are small and named: ``full_fsync`` uses ``F_FULLFSYNC`` on
macOS (plain fsync there does not reach stable storage) and ``fsync``
elsewhere; ``O_NOFOLLOW`` guards every open inside the root.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .digest import Hasher
from .errors import CorruptionError, ManifestError, QuarantineReason, StoreIOError
from .manifest import MAX_MANIFEST_BYTES, Manifest, decode

IS_DARWIN = sys.platform == "darwin"
FILE_MODE = 0o600
DIR_MODE = 0o700
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
READ_CHUNK = 8 << 20
# Granularity of the read/hash and write/hash pipelines.
PIPE_CHUNK = 2 << 20


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
    """Make a rename or unlink inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
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
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC, FILE_MODE))


def ensure_real_dirs(root: Path, directory: Path) -> None:
    """Raise OSError(ELOOP) unless ``root`` and every directory from it down to
    ``directory`` is a real directory, not a symlink.

    Called just before each write into the store, so a directory swapped for a link
    *after* the store was opened (TOCTOU) never redirects a write outside the root.
    This narrows the race to the moment between this check and the write; dir-fd based
    I/O (openat) would close it completely (docs/SECURITY.md).
    """
    current = root
    for part in ("", *directory.relative_to(root).parts):
        current = current / part if part else current
        st = os.lstat(current)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ELOOP, "store directory replaced by a symlink or file",
                          str(current))


def tmp_name() -> str:
    """A unique in-flight file name that records the writer's pid (for abandonment checks)."""
    return f"{os.getpid()}-{secrets.token_hex(8)}.part"


def io_error(exc: OSError, what: str, path: Path) -> StoreIOError:
    fix = {
        errno.ENOSPC: "free disk space or lower the store's max size",
        errno.EDQUOT: "raise the disk quota or lower the store's max size",
        errno.EROFS: "remount the filesystem read-write",
        errno.EACCES: "check the store's owner and permissions (`spoolctl doctor`)",
        errno.ELOOP: "a store directory was swapped for a symlink: inspect the store "
                     "before using it again",
    }.get(exc.errno or 0, "check the disk (`spoolctl doctor`, dmesg)")
    return StoreIOError(f"{what} failed: {os.strerror(exc.errno or 0)}", path=path, fix=fix)


def write_tmp(
    tmp_dir: Path, chunks: Iterable[bytes | bytearray | memoryview], *,
    on_written: Callable[[], None] | None = None,
) -> tuple[Path, str, int]:
    """Write ``chunks`` to a new file in ``tmp_dir`` (O_EXCL|O_NOFOLLOW, 0600), hash
    them on the way, fsync, and return ``(tmp_path, digest, size)``.

    ``on_written`` is called once the bytes are written, before the fsync (a crash-test
    checkpoint). On any error the partial file is removed and StoreIOError raised.
    """
    path = tmp_dir / tmp_name()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
    try:
        ensure_real_dirs(tmp_dir.parent, tmp_dir)
        fd = os.open(path, flags, FILE_MODE)
    except OSError as exc:
        raise io_error(exc, "creating a temporary file", path) from exc
    hasher = Hasher()
    size = 0
    try:
        try:
            views = []
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                views.append(view)
                while view:
                    n = os.write(fd, view)
                    size += n
                    view = view[n:]
            if on_written is not None:
                on_written()
            # The bytes are in the page cache: flush them to disk on a helper thread while
            # this thread hashes them, so a commit costs about write + max(fsync, hash).
            flushed = _submit(_fsync_pool, full_fsync, fd)
            try:
                for view in views:
                    hasher.update(view)
            finally:
                flushed.result()
        finally:
            os.close(fd)
    except OSError as exc:
        _unlink_quietly(path)
        raise io_error(exc, "writing", path) from exc
    except BaseException:
        _unlink_quietly(path)
        raise
    return path, hasher.hexdigest(), size


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def open_for_read(path: Path) -> int:
    """Open a store file for reading without following a symlink at its last component."""
    return os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)


def read_small(path: Path, limit: int) -> bytes:
    """Read a whole small file (manifest, marker) without following symlinks."""
    fd = open_for_read(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    return data


def read_manifest(path: Path, entry_id: str) -> Manifest:
    """Read and decode the manifest file of ``entry_id`` at ``path`` (bounded, no symlinks).

    Raises FileNotFoundError if there is none, ManifestError if it is unreadable or does
    not validate (including a manifest that belongs to another entry id).
    """
    try:
        data = read_small(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise FileNotFoundError(path) from None
        raise ManifestError(f"manifest unreadable: {os.strerror(exc.errno or 0)}",
                            reason=QuarantineReason.MANIFEST_IO, path=path,
                            entry_id=entry_id) from None
    return decode(data, expected_entry_id=entry_id, path=str(path))


_hash_pool_lock = threading.Lock()
_hash_pool: ThreadPoolExecutor | None = None


_fsync_pool_lock = threading.Lock()
_fsync_executor: ThreadPoolExecutor | None = None


def _fsync_pool() -> ThreadPoolExecutor:
    global _fsync_executor
    with _fsync_pool_lock:
        if _fsync_executor is None:
            _fsync_executor = ThreadPoolExecutor(max_workers=4,
                                                 thread_name_prefix="spoolctl-fsync")
        return _fsync_executor


def _pool() -> ThreadPoolExecutor:
    global _hash_pool
    with _hash_pool_lock:
        if _hash_pool is None:
            _hash_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spoolctl-hash")
        return _hash_pool


def _submit(pool: Callable[[], ThreadPoolExecutor], fn: Callable[..., Any],
            *args: Any) -> Future:
    """``pool().submit(fn, *args)``, or ``fn`` run here when the pool no longer accepts
    work: at interpreter exit ``concurrent.futures`` shuts its pools down before ``atexit``
    handlers run, and a commit or verified read made then must still work (only without
    the overlap)."""
    try:
        return pool().submit(fn, *args)
    except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:
            done.set_exception(exc)
        return done


def read_verified(
    path: Path, *, digest: str, size: int, into: memoryview | None = None
) -> memoryview:
    """Read the object at ``path`` and prove it is ``digest`` of ``size`` bytes, in one pass.

    Reading and hashing are pipelined (chunk i is hashed on a helper thread while
    chunk i+1 is read; both release the GIL), so verification costs little over a
    raw read. Returns a view of the bytes (``into`` if given). Raises
    ``FileNotFoundError`` if the object is missing, ``CorruptionError`` on a size
    or digest mismatch. The returned bytes are only ever handed out verified.
    """
    fd = open_for_read(path)
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise CorruptionError(
                f"object is {actual} bytes, manifest says {size}",
                reason=QuarantineReason.PAYLOAD_SIZE,
                path=path,
            )
        buf = into if into is not None else memoryview(bytearray(size))
        if len(buf) != size:
            raise ValueError("destination buffer has the wrong size")
        hasher = Hasher()
        pending = None
        offset = 0
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            while offset < size:
                end = min(offset + PIPE_CHUNK, size)
                window = buf[offset:end]
                got = 0
                while got < len(window):
                    n = f.readinto(window[got:])
                    if not n:
                        raise CorruptionError(
                            "object shorter than its size while reading",
                            reason=QuarantineReason.PAYLOAD_SIZE,
                            path=path,
                        )
                    got += n
                # Hash chunk i on the helper thread while chunk i+1 is read.
                if pending is not None:
                    pending.result()
                pending = _submit(_pool, hasher.update, window)
                offset = end
            if pending is not None:
                pending.result()
            if f.read(1):
                raise CorruptionError(
                    "object grew while reading", reason=QuarantineReason.PAYLOAD_SIZE, path=path
                )
    finally:
        os.close(fd)
    if hasher.hexdigest() != digest:
        raise CorruptionError(
            "object digest mismatch", reason=QuarantineReason.PAYLOAD_DIGEST, path=path
        )
    return buf


def hash_file(path: Path) -> tuple[str, int]:
    """Digest and size of a file (used to check an existing object before reuse)."""
    fd = open_for_read(path)
    hasher = Hasher()
    size = 0
    try:
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            buf = bytearray(READ_CHUNK)
            view = memoryview(buf)
            while True:
                n = f.readinto(view)
                if not n:
                    break
                hasher.update(view[:n])
                size += n
    finally:
        os.close(fd)
    return hasher.hexdigest(), size


def probe_o_direct(directory: Path) -> bool:
    """True if files in ``directory`` can be opened with O_DIRECT (Linux only)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    path = directory / f".odirect-probe-{tmp_name()}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flag | _O_CLOEXEC, FILE_MODE)
    except OSError:
        return False
    os.close(fd)
    _unlink_quietly(path)
    return True


# Unlinks are independent metadata operations that release the GIL; on filesystems where
# each one waits on the journal or an online discard (ext4 mounted with `discard`, common
# on VMs) a few in flight at once are an order of magnitude faster than one at a time.
UNLINK_WORKERS = 8
_unlink_pool_lock = threading.Lock()
_unlink_pool: ThreadPoolExecutor | None = None


def _unlink_sized(path: Path) -> int | None:
    """Unlink ``path``; return its size, or None if it was already gone."""
    try:
        size = os.lstat(path).st_size
        os.unlink(path)
    except FileNotFoundError:
        return None
    return size


def unlink_many(paths: list[Path]) -> Iterable[int | None]:
    """Unlink ``paths`` concurrently; yield, in order, each one's size (None if absent).

    Results are yielded as they complete in order, so a caller can mark a checkpoint
    after each; other unlinks may already be in flight at that moment.
    """
    global _unlink_pool
    if len(paths) < 2 * UNLINK_WORKERS:
        return (_unlink_sized(p) for p in paths)
    with _unlink_pool_lock:
        if _unlink_pool is None:
            _unlink_pool = ThreadPoolExecutor(max_workers=UNLINK_WORKERS,
                                              thread_name_prefix="spoolctl-unlink")
        pool = _unlink_pool
    return pool.map(_unlink_sized, paths)
