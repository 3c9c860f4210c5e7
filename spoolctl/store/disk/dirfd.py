"""Directory descriptors: how the store deletes, creates and renames.

Whoever can write a store can swap any of its directories for a symlink at any moment, so
every delete, create and rename under a root goes through a descriptor of the directory
it acts in, opened component by component from ``/`` with ``O_DIRECTORY|O_NOFOLLOW``
(``open_dir``), and names one entry of it. A directory swapped before the open is refused
(OSError ``ELOOP``/``ENOTDIR``); one swapped after it is no longer reached. ``DirFds``
keeps descriptors for one pass only (a directory recreated since would be stale).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_DIR_FLAGS = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC
# The directories on the way are opened for search only where the platform can (Linux's
# O_PATH): a parent such as a home directory in mode 0711 can be crossed but not read, and
# a plain O_RDONLY open of it would fail where the path itself works. The last directory is
# opened for reading (it is listed, fsynced, fchmod-ed).
_PASS_FLAGS = (getattr(os, "O_PATH", 0) | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC
               if hasattr(os, "O_PATH") else _DIR_FLAGS)
# ``os.unlink(dir_fd=)`` and friends: every POSIX platform the store runs on (Linux, macOS).
SUPPORTED = os.open in os.supports_dir_fd and os.unlink in os.supports_dir_fd


# Roots another user owns, opened by this process (``guard``): their trailing-separator
# path -> (uid, gid) of the owner. Under them every path is resolved by ``open_dir``'s walk,
# and what root creates is handed to the owner through its own descriptor (``give``).
_GUARDED: dict[str, tuple[int, int]] = {}


def guard(root: str | os.PathLike[str], st: os.stat_result) -> None:
    """Resolve every path under ``root`` (whose ``lstat`` is ``st``) by descriptors from now
    on if another user owns it (its owner can swap its directories meanwhile)."""
    if not hasattr(os, "geteuid") or st.st_uid == os.geteuid():
        return
    _GUARDED[os.path.join(os.path.normpath(os.fspath(root)), "")] = (st.st_uid, st.st_gid)


def guarded(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` lies under a root another user owns (``guard``)."""
    if not _GUARDED:
        return False
    text = os.fspath(path)
    return any(text.startswith(top) for top in _GUARDED)


def _owner(path: str) -> tuple[int, int] | None:
    """The (uid, gid) owning the guarded root ``path`` lies under, or None."""
    if not _GUARDED:
        return None
    return next((who for top, who in _GUARDED.items() if path.startswith(top)), None)


def give(fd: int, path: str | os.PathLike[str]) -> None:
    """Hand the file or directory just created at ``fd`` (``path``) in a guarded root to
    its owner, through the descriptor: root chowns it; anyone else shares it through the
    root's group (the group gets the owner bits)."""
    who = _owner(os.fspath(path))
    if who is None:
        return
    if os.geteuid() == 0:
        os.fchown(fd, *who)
        return
    with contextlib.suppress(PermissionError):  # only a group this user is a member of
        os.fchown(fd, -1, who[1])
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    os.fchmod(fd, mode | (mode & 0o700) >> 3)


def open_dir(path: str | os.PathLike[str]) -> int:
    """A descriptor of the directory at absolute ``path`` (the caller closes it), each
    component opened relative to the one before with ``O_DIRECTORY|O_NOFOLLOW``.

    OSError ``ELOOP``/``ENOTDIR`` for a symlink or non-directory on the way, ``ENOENT``,
    ``EACCES``; ValueError for a relative path."""
    text = os.fspath(path)
    if not os.path.isabs(text):
        raise ValueError(f"not an absolute path: {text!r}")
    return _walk(text, None)


def makedirs(path: str | os.PathLike[str], mode: int) -> int:
    """Create absolute ``path`` and every missing parent with exactly ``mode`` (fchmod:
    not the umask's), walking as ``open_dir`` does; existing directories are kept.
    Returns a descriptor of ``path`` (the caller closes it). OSError as ``open_dir``."""
    text = os.fspath(path)
    if not os.path.isabs(text):
        raise ValueError(f"not an absolute path: {text!r}")
    return _walk(text, mode)


def _walk(text: str, mode: int | None) -> int:
    """``open_dir`` (``mode`` None) or ``makedirs`` (``mode``) of absolute ``text``."""
    parts = [p for p in os.path.normpath(text).split(os.sep) if p]
    fd = os.open("/", _PASS_FLAGS if parts else _DIR_FLAGS)
    try:
        for i, part in enumerate(parts):
            nxt = _step(fd, part, text, mode, last=i == len(parts) - 1)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _step(fd: int, part: str, text: str, mode: int | None, *, last: bool) -> int:
    """Open ``part`` of the directory at ``fd`` (creating it with ``mode`` if missing and
    ``mode`` is given); errors are named after the whole path, as a plain open's would."""
    flags = _DIR_FLAGS if last else _PASS_FLAGS
    try:
        try:
            return os.open(part, flags, dir_fd=fd)
        except FileNotFoundError:
            if mode is None:
                raise
        try:
            os.mkdir(part, mode, dir_fd=fd)
        except FileExistsError:
            return os.open(part, flags, dir_fd=fd)  # made meanwhile: someone else's
        made = os.open(part, _DIR_FLAGS, dir_fd=fd)  # readable: fchmod needs a real fd
        try:
            os.fchmod(made, mode)  # the umask only took bits away; this is the mode asked
            give(made, text)
        except BaseException:
            os.close(made)
            raise
        return made
    except OSError as exc:
        code = exc.errno
        if code == errno.ENOTDIR and _is_link(part, fd):
            code = errno.ELOOP  # Linux says ENOTDIR for a link under O_DIRECTORY
        raise OSError(code, os.strerror(code or 0), text) from None


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def open_sub(dir_fd: int, name: str, path: str | os.PathLike[str]) -> int:
    """A readable descriptor of directory ``name`` in the one open at ``dir_fd``, never
    through a link (OSError ``ELOOP`` naming ``path`` if it is one)."""
    return _step(dir_fd, name, os.fspath(path), None, last=True)


@contextlib.contextmanager
def opened(path: str | os.PathLike[str]) -> Iterator[int]:
    """``open_dir(path)`` as a context manager (closed on exit)."""
    fd = open_dir(path)
    try:
        yield fd
    finally:
        os.close(fd)


def _split(path: str | os.PathLike[str]) -> tuple[str, str]:
    parent, name = os.path.split(os.fspath(path))
    if not name or name in (".", ".."):
        raise ValueError(f"no file name in {os.fspath(path)!r}")
    return parent, name


def unlink(path: str | os.PathLike[str]) -> None:
    """Remove the file at ``path`` through its directory's descriptor (OSError as
    ``os.unlink``, plus ``ELOOP`` for a symlinked directory on the way)."""
    parent, name = _split(path)
    with opened(parent) as fd:
        os.unlink(name, dir_fd=fd)


def create(path: str | os.PathLike[str], flags: int, mode: int) -> int:
    """``os.open(path, flags | O_NOFOLLOW, mode)`` through its directory's descriptor. A
    file it creates in a root another user owns is that user's (``give``)."""
    parent, name = _split(path)
    with opened(parent) as fd:
        return open_at(fd, name, flags, mode, path)


def open_at(dir_fd: int, name: str, flags: int, mode: int,
            path: str | os.PathLike[str]) -> int:
    """``os.open(name, flags | O_NOFOLLOW, mode, dir_fd=)``; with ``O_CREAT`` and without
    ``O_EXCL`` it tries an exclusive create first, so a file it made (and only that) goes
    to the owner of a guarded root (``give``; ``path`` names it)."""
    flags |= _O_NOFOLLOW | _O_CLOEXEC
    if not flags & os.O_CREAT or _owner(os.fspath(path)) is None:
        return os.open(name, flags, mode, dir_fd=dir_fd)
    if not flags & os.O_EXCL:
        try:
            fd = os.open(name, flags | os.O_EXCL, mode, dir_fd=dir_fd)
        except FileExistsError:
            return os.open(name, flags & ~os.O_CREAT, mode, dir_fd=dir_fd)
    else:
        fd = os.open(name, flags, mode, dir_fd=dir_fd)
    try:
        give(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
    """Open the file at absolute ``path`` without following a link anywhere: by its
    directory's descriptor under a guarded root (``create``), else by name with
    ``O_NOFOLLOW`` (only the store's own user can write the directories on the way)."""
    if guarded(path):
        return create(path, flags, mode)
    return os.open(path, flags | _O_NOFOLLOW | _O_CLOEXEC, mode)


def mkdir(path: str | os.PathLike[str], mode: int) -> None:
    """``os.mkdir(path, mode)`` through its parent's descriptor (the owner's, ``give``, in
    a root another user owns)."""
    parent, name = _split(path)
    with opened(parent) as fd:
        mkdir_at(fd, name, mode, path)


def mkdir_at(dir_fd: int, name: str, mode: int, path: str | os.PathLike[str]) -> None:
    """``os.mkdir(name, mode, dir_fd=)``, the new directory then given (``give``)."""
    os.mkdir(name, mode, dir_fd=dir_fd)
    if _owner(os.fspath(path)) is not None:
        made = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        try:
            give(made, path)
        finally:
            os.close(made)


def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """``os.replace(src, dst)`` through the descriptors of both directories."""
    src_parent, src_name = _split(src)
    dst_parent, dst_name = _split(dst)
    with opened(src_parent) as sfd:
        if dst_parent == src_parent:
            os.replace(src_name, dst_name, src_dir_fd=sfd, dst_dir_fd=sfd)
            return
        with opened(dst_parent) as dfd:
            os.replace(src_name, dst_name, src_dir_fd=sfd, dst_dir_fd=dfd)


# Deeper than this, ``rmtree`` leaves a tree in place: one descriptor is held per level, and
# nothing spoolctl writes is more than two levels deep (a deeper tree was planted).
MAX_TREE_DEPTH = 64


def rmtree(path: str | os.PathLike[str], *, max_depth: int = MAX_TREE_DEPTH) -> list[str]:
    """Remove the tree at ``path`` without following a symlink anywhere in it, without
    recursion. Directories deeper than ``max_depth`` (and those holding them) are kept;
    returns the deepest kept ones, an empty list when all of it is gone."""
    parent, name = _split(path)
    with opened(parent) as fd:
        skipped = _rmtree_under(fd, name, os.fspath(path), max_depth)
        if not skipped:
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(name, dir_fd=fd)
    return skipped


@dataclass(frozen=True)
class Entry:
    """One entry of a directory listed through its descriptor: name, path, and ``lstat``."""

    name: str
    path: str
    st: os.stat_result

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        return self.st  # never through a link: a link is reported as one

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        return stat.S_ISDIR(self.st.st_mode)

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        return stat.S_ISREG(self.st.st_mode)

    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self.st.st_mode)

    def inode(self) -> int:
        return self.st.st_ino


class DirEntryLike(Protocol):
    """What ``scandir`` returns: an ``os.DirEntry`` or an ``Entry``."""

    @property
    def name(self) -> str: ...
    @property
    def path(self) -> str: ...
    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result: ...
    def is_dir(self, *, follow_symlinks: bool = True) -> bool: ...
    def is_file(self, *, follow_symlinks: bool = True) -> bool: ...
    def is_symlink(self) -> bool: ...
    def inode(self) -> int: ...


def scandir(path: str | os.PathLike[str]) -> list[DirEntryLike]:
    """The entries of the directory at ``path``: under a guarded root through
    ``open_dir``'s descriptor (``Entry``), elsewhere ``os.scandir``. OSError as
    ``os.scandir``."""
    text = os.fspath(path)
    if not guarded(text):
        with os.scandir(text) as it:
            return list(it)
    out: list[DirEntryLike] = []
    with opened(text) as fd:
        for e in listing(fd):
            try:
                st = os.stat(e.name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            out.append(Entry(e.name, os.path.join(text, e.name), st))
    return out


def listdir(path: str | os.PathLike[str]) -> list[str]:
    """``os.listdir(path)``, through ``open_dir``'s descriptor under a guarded root."""
    if not guarded(path):
        return os.listdir(path)
    with opened(path) as fd:
        return os.listdir(fd)


def lstat(path: str | os.PathLike[str]) -> os.stat_result:
    """``os.lstat(path)``, relative to its directory's descriptor under a guarded root."""
    if not guarded(path):
        return os.lstat(path)
    parent, name = _split(path)
    with opened(parent) as fd:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)


class _Level:
    """One open directory of an ``rmtree`` walk: its descriptor and what is left of it."""

    def __init__(self, fd: int, path: str):
        self.fd, self.path, self.kept = fd, path, False
        self.left = [(e.name, e.is_dir(follow_symlinks=False)) for e in listing(fd)]


def _rmtree_under(parent_fd: int, name: str, path: str, max_depth: int) -> list[str]:
    """Empty the directory ``name`` of ``parent_fd`` (see ``rmtree``); it stays itself."""
    skipped: list[str] = []
    try:
        stack = [_Level(os.open(name, _DIR_FLAGS, dir_fd=parent_fd), path)]
    except FileNotFoundError:
        return skipped
    try:
        while stack:
            top = stack[-1]
            if not top.left:
                stack.pop()
                os.close(top.fd)
                if stack and top.kept:
                    stack[-1].kept = True
                elif stack:
                    with contextlib.suppress(FileNotFoundError):
                        os.rmdir(os.path.basename(top.path), dir_fd=stack[-1].fd)
                continue
            entry, is_dir = top.left.pop()
            if not is_dir:
                _unlink_entry(top.fd, entry)
            elif len(stack) > max_depth:
                top.kept = True
                skipped.append(os.path.join(top.path, entry))
            else:
                child = _open_subdir(top.fd, entry)
                if child is not None:
                    stack.append(_Level(child, os.path.join(top.path, entry)))
    finally:
        for level in stack:
            os.close(level.fd)
    return skipped


def _open_subdir(fd: int, name: str) -> int | None:
    """A descriptor of directory ``name`` of ``fd``; None when it is gone, or was swapped
    for a symlink or a file since the listing (then that is unlinked instead)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
    _unlink_entry(fd, name)
    return None


def _unlink_entry(fd: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=fd)


def listing(fd: int, limit: int | None = None) -> list[os.DirEntry[str]]:
    """The entries of the directory open at ``fd`` (at most ``limit``, read no further)."""
    with os.scandir(fd) as it:
        return list(it) if limit is None else list(itertools.islice(it, limit))


class DirFds:
    """Directory descriptors opened once each for one pass over many files; thread-safe.
    Close it when the pass ends."""

    def __init__(self) -> None:
        self._fds: dict[str, int | OSError] = {}
        self._lock = threading.Lock()

    def fd(self, directory: str | os.PathLike[str]) -> int:
        """The descriptor of absolute ``directory``, opened on first use relative to its
        parent's (kept too), for ``*at`` calls only. A failed open's OSError is raised again
        on every later use."""
        key = os.path.normpath(os.fspath(directory))
        if not os.path.isabs(key):
            raise ValueError(f"not an absolute path: {key!r}")
        with self._lock:
            got = self._open(key)
        if isinstance(got, OSError):
            raise OSError(got.errno, got.strerror, got.filename)
        return got

    def _open(self, key: str) -> int | OSError:
        got = self._fds.get(key)
        if got is not None:
            return got
        parent, name = os.path.split(key)
        if not name:  # the root directory
            got = os.open(key, _PASS_FLAGS)
        else:
            up = self._open(parent)
            if isinstance(up, OSError):
                got = OSError(up.errno, up.strerror, key)
            else:
                try:
                    got = _step(up, name, key, None, last=False)
                except OSError as exc:
                    got = exc
        self._fds[key] = got
        return got

    def unlink(self, path: str | os.PathLike[str]) -> None:
        """``os.unlink`` of ``path`` through its directory's descriptor."""
        parent, name = _split(path)
        os.unlink(name, dir_fd=self.fd(parent))

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            if isinstance(fd, int):
                os.close(fd)

    def __enter__(self) -> DirFds:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
