"""Store roots: validation, the ``.spoolctl-root`` marker, and the directory layout.

A root is absolute and reached through no symlink; it is created only when new or empty,
adopted only with a valid marker, and used only by the user who owns it (an empty
directory included). A read-only open creates and rewrites nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ...errors import InvalidIdError, RootError, access_denied
from . import dirfd, faults
from .fsio import (
    DIR_MODE,
    describe_os_error,
    fsync_dir,
    full_fsync,
    io_error,
    read_small,
    tmp_writer,
    write_tmp,
)

MARKER = ".spoolctl-root"
ROOT_SCHEMA = "spoolctl-root/v1"
# A store holding something a reader must understand has a v2 marker naming it in
# ``requires``: older versions refuse any schema but v1, newer ones an unknown feature.
ROOT_SCHEMA_V2 = "spoolctl-root/v2"
# Objects sealed under a random 63-bit key id (SPS2 headers): a spoolctl that reads only
# SPS1 would quarantine them as corrupt.
FEATURE_SEALED_V2 = "sealed-v2"
# Hints kept in ``state/hints.log`` besides the catalog, which a rebuild reads: a spoolctl
# that does not know it would change hints without the log (a later rebuild would bring
# back stale ones) and, before catalog schema 2, rebuild this one's catalog as damaged.
FEATURE_HINTS_LOG = "hints-log"
# Objects bound to their entry and name (SPS3 headers): a spoolctl that reads only SPS1/SPS2
# would quarantine them as corrupt.
FEATURE_SEALED_V3 = "sealed-v3"
KNOWN_FEATURES = frozenset((FEATURE_SEALED_V2, FEATURE_HINTS_LOG, FEATURE_SEALED_V3))
_FEATURE_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")
SUBDIRS = ("objects", "manifests", "tmp", "quarantine", "state")
FANOUT = [f"{i:02x}" for i in range(256)]
KNOWN_TOP = frozenset((MARKER, *SUBDIRS))
_STORE_ID_RE = re.compile(r"[0-9A-Za-z_-]{1,64}")
_HEX64_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class StorePaths:
    """Paths inside one store root."""

    root: Path

    @property
    def marker(self) -> Path:
        return self.root / MARKER

    @property
    def objects(self) -> Path:
        return self.root / "objects"

    @property
    def manifests(self) -> Path:
        return self.root / "manifests"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    @property
    def state(self) -> Path:
        return self.root / "state"

    def object_path(self, digest: str) -> Path:
        return self.objects / digest[:2] / f"{_hex64(digest, 'object digest')}.obj"

    def manifest_path(self, entry_id: str) -> Path:
        return self.manifests / entry_id[:2] / f"{_hex64(entry_id, 'entry id')}.json"


def _hex64(value: str, what: str) -> str:
    """``value`` if it is 64 lowercase hex characters (the only thing a path is built
    from), else InvalidIdError."""
    if not isinstance(value, str) or not _HEX64_RE.fullmatch(value):
        raise InvalidIdError(f"invalid {what} {str(value)[:80]!r}",
                             fix="this value came from a damaged catalog or file: run "
                                 "`spoolctl doctor`")
    return value


@dataclass(frozen=True)
class Marker:
    """Contents of ``.spoolctl-root``. ``requires``: the features a reader must know
    (sorted; empty: a v1 marker)."""

    store_id: str
    created: float
    max_bytes: int | None
    requires: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "schema": ROOT_SCHEMA_V2 if self.requires else ROOT_SCHEMA,
            "store_id": self.store_id,
            "created": self.created,
            "max_bytes": self.max_bytes,
        }
        if self.requires:
            doc["requires"] = sorted(self.requires)
        return doc


# SQLite's unix VFS cannot open a database whose path, with the "-journal" it appends, is 512
# bytes or more; the longest database name in a store is state/auth_requests.sqlite3.
SQLITE_MAX_PATH = 512
MAX_ROOT_BYTES = SQLITE_MAX_PATH - len("-journal") - len("/state/auth_requests.sqlite3")
NAME_MAX = 255  # one path component, on every filesystem the store runs on


def check_root_path(root: str | os.PathLike[str]) -> Path:
    """Refuse a relative root, one too long for the store's files, or one whose path
    crosses a symlink; return it as a Path. Nothing is created before these checks."""
    text = os.fspath(root)
    if not text or not os.path.isabs(text):
        raise RootError(
            "store root must be an absolute path",
            path=text or "''",
            fix="pass an absolute path, e.g. --root /var/cache/spoolctl",
        )
    path = Path(os.path.normpath(text))
    size = len(os.fsencode(path))
    if size > MAX_ROOT_BYTES:
        raise RootError(
            f"store root path is too long: {size} bytes, at most {MAX_ROOT_BYTES} (SQLite "
            "cannot open the store's catalog under a longer one)", path=path,
            fix="choose a shorter path, e.g. a bind mount of the directory at a short one")
    longest = max((len(os.fsencode(part)) for part in path.parts[1:]), default=0)
    if longest > NAME_MAX:
        raise RootError(f"a name in the store root path is too long: {longest} bytes, at "
                        f"most {NAME_MAX}", path=path, fix="choose a path with shorter names")
    current = Path(path.anchor)
    for part in path.parts[1:]:
        current = current / part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            break
        except PermissionError:
            raise access_denied(path, action="reach") from None
        except OSError as exc:
            raise RootError(f"the store root path cannot be used: {os.strerror(exc.errno or 0)}",
                            path=current, fix="choose another root") from None
        if stat.S_ISLNK(st.st_mode):
            raise RootError(
                "store root path goes through a symlink",
                path=current,
                fix=f"use the real path ({os.path.realpath(current)}) instead of the link",
            )
        if current != path and not stat.S_ISDIR(st.st_mode):
            raise RootError("a parent of the store root is not a directory", path=current,
                            fix="choose another root")
    return path


def read_marker(layout: StorePaths) -> Marker:
    """Read and validate the root marker; RootError if it is missing or foreign."""
    try:
        data = read_small(layout.marker, 1 << 16)
        doc = json.loads(data)
    except FileNotFoundError:
        raise RootError(
            "not a spoolctl store (no .spoolctl-root marker)",
            path=layout.root,
            fix="run `spoolctl init --root PATH` to create a store there",
        ) from None
    except OSError as exc:
        raise RootError(
            f"unreadable store marker: {describe_os_error(exc)}",
            path=layout.marker,
            fix="make it a readable regular file again (see docs/format.md), or move the "
                "store aside",
        ) from None
    except (ValueError, RecursionError):
        raise RootError(
            "store marker is not valid JSON",
            path=layout.marker,
            fix="restore it (see docs/format.md for its fields), or move the store aside",
        ) from None
    return marker_from_json(doc, layout.marker)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def marker_from_json(doc: object, path: Path) -> Marker:
    """Validate a parsed marker strictly (types, not just presence); RootError if wrong.
    ``max_bytes``: a positive integer or null (``true`` is not 1 byte). ``requires``: a
    list of feature names this version knows."""
    if not isinstance(doc, dict) or doc.get("schema") not in (ROOT_SCHEMA, ROOT_SCHEMA_V2):
        schema = doc.get("schema") if isinstance(doc, dict) else None
        raise RootError(
            f"store marker has schema {str(schema)[:60]!r}, expected {ROOT_SCHEMA!r} or "
            f"{ROOT_SCHEMA_V2!r}",
            path=path,
            fix="this root belongs to another tool or version; use a different --root",
        )
    fix = "correct it by hand (docs/format.md) or move the store aside"
    requires: tuple[str, ...] = ()
    if doc["schema"] == ROOT_SCHEMA_V2:
        given = doc.get("requires")
        if not isinstance(given, list) or not given or not all(
                isinstance(f, str) and _FEATURE_RE.fullmatch(f) for f in given):
            raise RootError(f"store marker has an invalid requires ({_show(given)}): it must "
                            "be a non-empty list of feature names", path=path, fix=fix)
        unknown = sorted(set(given) - KNOWN_FEATURES)
        if unknown:
            raise RootError(
                f"the store uses {', '.join(unknown)}, which this spoolctl does not know "
                "(written by a newer version)", path=path,
                fix="upgrade spoolctl to the version that wrote the store (docs/format.md, "
                    "the root marker)")
        requires = tuple(sorted(set(given)))
    max_bytes = doc.get("max_bytes")
    if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool)
                                  or max_bytes <= 0):
        raise RootError(f"store marker has an invalid max_bytes ({_show(max_bytes)}): it must "
                        "be a positive integer or null", path=path,
                        fix="set it again with `spoolctl init --root PATH --max-size SIZE`")
    created = doc.get("created", 0.0)
    if not _number(created):
        raise RootError(f"store marker has an invalid created ({_show(created)}): it must be "
                        "a number (unix seconds)", path=path, fix=fix)
    store_id = doc.get("store_id", "")
    if not isinstance(store_id, str) or not _STORE_ID_RE.fullmatch(store_id):
        raise RootError(f"store marker has an invalid store_id ({_show(store_id)})",
                        path=path, fix=fix)
    return Marker(store_id=store_id, created=float(created), max_bytes=max_bytes,
                  requires=requires)


def _show(value: object) -> str:
    """A short, one-line rendering of a hand-edited value for an error message."""
    text = json.dumps(value, ensure_ascii=True, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def write_marker(layout: StorePaths, marker: Marker, *, new: bool = False) -> Marker:
    """Atomically (re)write the marker and return what was written; ``new``: the store is
    being created. Features the marker on disk requires are kept. StoreIOError."""
    if not new:
        with contextlib.suppress(RootError):
            on_disk = read_marker(layout).requires
            if not set(on_disk) <= set(marker.requires):
                marker = replace(marker, requires=tuple(sorted({*marker.requires, *on_disk})))
    data = json.dumps(marker.to_json(), indent=2).encode() + b"\n"
    tmp_dir = layout.tmp if layout.tmp.is_dir() else layout.root
    tmp, _, _ = write_tmp(tmp_dir, [data])
    if new:
        faults.checkpoint("init.marker_drafted")
    try:
        dirfd.replace(tmp, layout.marker)  # the draft is the owner's from its creation
    except OSError as exc:
        # A root this user cannot write: one StoreIOError naming the fix (read-only
        # commands then fall back to a read-only view), and no draft left in tmp/.
        with contextlib.suppress(OSError):
            dirfd.unlink(tmp)
        raise io_error(exc, "writing the store marker", layout.marker) from None
    fsync_dir(layout.root)
    return marker


def require_feature(layout: StorePaths, feature: str) -> Marker:
    """Make the marker require ``feature`` before the store holds anything that needs it,
    so an older spoolctl refuses the store instead of misreading it; returns the marker."""
    assert feature in KNOWN_FEATURES, feature
    marker = read_marker(layout)
    if feature in marker.requires:
        return marker
    return write_marker(layout, replace(marker, requires=(*marker.requires, feature)))


def _mkdir(dir_fd: int, name: str, path: Path) -> bool:
    """Create 0700 directory ``name`` in the one open at ``dir_fd`` (``path``); return True
    if it was created, False if it existed."""
    try:
        dirfd.mkdir_at(dir_fd, name, DIR_MODE, path)
        return True
    except FileExistsError:
        pass
    except OSError as exc:  # named after the whole path, as a plain mkdir's would be
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False  # removed meanwhile: the next open reports it
    if not stat.S_ISDIR(st.st_mode):
        raise RootError("expected a directory", path=path,
                        fix="remove the file or symlink in its place")
    return False


def ensure_layout(layout: StorePaths) -> None:
    """Create every directory of the layout (idempotent) through its parent's descriptor;
    fsync only what changed. StoreIOError if the filesystem refuses (what was made stays:
    the next ``init`` finishes it)."""
    try:
        with dirfd.opened(layout.root) as top:
            _ensure_layout(layout, top)
    except OSError as exc:
        raise io_error(exc, "creating the store layout",
                       Path(exc.filename) if exc.filename else layout.root) from None


def _ensure_layout(layout: StorePaths, top: int) -> None:
    created_top = [_mkdir(top, name, layout.root / name) for name in SUBDIRS]
    for parent in (layout.objects, layout.manifests):
        fd = dirfd.open_sub(top, parent.name, parent)
        try:
            _ensure_fans(parent, fd)
        finally:
            os.close(fd)
    if any(created_top):
        full_fsync(top)


def _ensure_fans(parent: Path, fd: int) -> None:
    existing = set(os.listdir(fd))
    for fan in existing.intersection(FANOUT):
        # a fan-out "directory" that is a symlink would send renames outside the root
        if not stat.S_ISDIR(os.stat(fan, dir_fd=fd, follow_symlinks=False).st_mode):
            raise RootError("expected a directory, found a symlink or file", path=parent / fan,
                            fix="remove it; spoolctl recreates the directory")
    missing = [fan for fan in FANOUT if fan not in existing]
    for fan in missing:
        _mkdir(fd, fan, parent / fan)
    if missing:
        full_fsync(fd)


ALLOW_FOREIGN_ENV = "SPOOLCTL_ALLOW_FOREIGN_OWNER"


def check_owner(root: Path, *, allow_foreign_owner: bool, st: os.stat_result | None = None
                ) -> None:
    """Refuse a root owned by another user (including root's own use of a user's store):
    acting on it would create files the owner cannot read and mix tenants' data."""
    if allow_foreign_owner or os.environ.get(ALLOW_FOREIGN_ENV) == "1" or os.name != "posix":
        return
    owner = (st or os.lstat(root)).st_uid
    if owner != os.geteuid():
        raise RootError(
            f"store root is owned by uid {owner}, not by this user (uid {os.geteuid()})",
            path=root,
            fix=f"run as the owner, or pass --allow-foreign-owner ({ALLOW_FOREIGN_ENV}=1)",
        )


def check_layout(layout: StorePaths) -> None:
    """For a read-only open: every directory of the layout exists as a real directory."""
    for name in SUBDIRS:
        try:
            st = os.lstat(layout.root / name)
        except FileNotFoundError:
            raise RootError(f"store layout is incomplete: {name}/ is missing",
                            path=layout.root / name,
                            fix="open the store once as its owner (e.g. `spoolctl status`) "
                                "to recreate it") from None
        if not stat.S_ISDIR(st.st_mode):
            raise RootError("expected a directory, found a symlink or file",
                            path=layout.root / name, fix="inspect the store before using it")


def unfinished_init(layout: StorePaths) -> list[Path] | None:
    """If ``layout.root`` (without a marker) holds nothing but what an interrupted
    ``init`` creates (top directories, empty fan-outs, small marker drafts in ``tmp/``),
    return those drafts (to remove); else None. An empty directory is None too.
    """
    drafts: list[Path] = []
    try:
        names = dirfd.listdir(layout.root)
        if not names:  # empty: nothing was started here (a fresh or unmounted vLLM root)
            return None
        for name in names:
            path = layout.root / name
            if name not in SUBDIRS or not stat.S_ISDIR(dirfd.lstat(path).st_mode):
                return None
            for child in dirfd.listdir(path):
                cst = dirfd.lstat(path / child)
                if name in ("objects", "manifests") and child in FANOUT and \
                        stat.S_ISDIR(cst.st_mode) and not dirfd.listdir(path / child):
                    continue
                if name == "tmp" and tmp_writer(child) is not None and \
                        stat.S_ISREG(cst.st_mode) and cst.st_size <= 1 << 16:
                    drafts.append(path / child)
                    continue
                return None
    except OSError:
        return None
    return drafts


def create_or_adopt(
    root: Path, *, create: bool, max_bytes: int | None, allow_foreign_owner: bool = False,
    read_only: bool = False,
) -> tuple[StorePaths, Marker]:
    """Open the root at ``root``; create it when ``create`` and it is new or empty.

    RootError for a non-empty directory without a marker, a foreign or malformed marker,
    and (unless ``allow_foreign_owner``) a root owned by another user. ``max_bytes`` (when
    given) is recorded in the marker. ``read_only`` creates and rewrites nothing.
    """
    layout = StorePaths(root)
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise RootError("store root is not a directory", path=root, fix="choose another --root")
    if st is not None:
        dirfd.guard(root, st)  # another user's root: its owner may swap what is under it
    has_marker = st is not None and os.path.lexists(layout.marker)
    if read_only:
        if st is None:
            raise RootError("store root does not exist", path=root, fix="check the path")
        marker = read_marker(layout)
        check_layout(layout)
        return layout, marker
    if not has_marker:
        if not create:
            if st is None:
                raise RootError("store root does not exist", path=root,
                                fix="run `spoolctl init --root PATH` first, or check the path")
            if unfinished_init(layout) is not None:
                raise RootError("an unfinished `spoolctl init` (no .spoolctl-root marker yet)",
                                path=root, fix="run `spoolctl init --root PATH` again to "
                                               "finish it")
            read_marker(layout)  # raises the "not a spoolctl store" error
        leftovers: list[Path] | None = []
        if st is not None and os.listdir(root):
            # An init that was interrupted (Ctrl-C) or failed (no inodes left) leaves its
            # directories without the marker; the next init finishes it.
            leftovers = unfinished_init(layout)
            if leftovers is None:
                raise RootError(
                    "refusing to adopt a non-empty directory without a .spoolctl-root marker",
                    path=root,
                    fix="point --root at an empty or new directory",
                )
        if st is not None:
            # The foreign-owner rule holds from the first open: an empty directory someone
            # else owns is theirs (creating the store in it would seed files they cannot use).
            check_owner(root, allow_foreign_owner=allow_foreign_owner, st=st)
        # Every directory made on the way gets DIR_MODE whatever the umask, the root's
        # through its own descriptor: a writer of a parent could swap the path for a link.
        fd = dirfd.makedirs(root, DIR_MODE)
        try:
            os.fchmod(fd, DIR_MODE)
        finally:
            os.close(fd)
        marker = Marker(store_id=secrets.token_hex(8), created=time.time(), max_bytes=max_bytes)
        ensure_layout(layout)
        faults.checkpoint("init.layout_made")
        for part in leftovers or ():  # the unfinished init's own marker draft
            with contextlib.suppress(FileNotFoundError):
                dirfd.unlink(part)
        write_marker(layout, marker, new=True)
        return layout, marker
    check_owner(root, allow_foreign_owner=allow_foreign_owner)
    marker = read_marker(layout)
    ensure_layout(layout)
    if max_bytes is not None and max_bytes != marker.max_bytes:
        marker = write_marker(layout, replace(marker, max_bytes=max_bytes))
    return layout, marker
