"""Store roots: validation, the ``.spoolctl-root`` marker, and the directory layout."""

from __future__ import annotations

import json
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import RootError
from .fsio import DIR_MODE, fsync_dir, read_small, write_tmp

MARKER = ".spoolctl-root"
ROOT_SCHEMA = "spoolctl-root/v1"
SUBDIRS = ("objects", "manifests", "tmp", "quarantine", "state")
FANOUT = [f"{i:02x}" for i in range(256)]
KNOWN_TOP = frozenset((MARKER, *SUBDIRS))


@dataclass(frozen=True)
class Layout:
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
        return self.objects / digest[:2] / f"{digest}.obj"

    def manifest_path(self, entry_id: str) -> Path:
        return self.manifests / entry_id[:2] / f"{entry_id}.json"


@dataclass(frozen=True)
class Marker:
    """Contents of ``.spoolctl-root``."""

    store_id: str
    created: float
    max_bytes: int | None

    def to_json(self) -> dict:
        return {
            "schema": ROOT_SCHEMA,
            "store_id": self.store_id,
            "created": self.created,
            "max_bytes": self.max_bytes,
        }


def check_root_path(root: str | os.PathLike[str]) -> Path:
    """Refuse a relative root or one whose path crosses a symlink; return it as a Path."""
    text = os.fspath(root)
    if not text or not os.path.isabs(text):
        raise RootError(
            "store root must be an absolute path",
            path=text or "''",
            fix="pass an absolute path, e.g. --root /var/cache/spoolctl",
        )
    path = Path(os.path.normpath(text))
    current = Path(path.anchor)
    for part in path.parts[1:]:
        current = current / part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            break
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


def read_marker(layout: Layout) -> Marker:
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
    except (OSError, ValueError) as exc:
        raise RootError(
            f"unreadable store marker ({type(exc).__name__})",
            path=layout.marker,
            fix="check the file; if the store is damaged move it aside and run `spoolctl init`",
        ) from None
    if not isinstance(doc, dict) or doc.get("schema") != ROOT_SCHEMA:
        schema = doc.get("schema") if isinstance(doc, dict) else None
        raise RootError(
            f"store marker has schema {str(schema)[:60]!r}, expected {ROOT_SCHEMA!r}",
            path=layout.marker,
            fix="this root belongs to another tool or version; use a different --root",
        )
    max_bytes = doc.get("max_bytes")
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
        raise RootError("store marker has an invalid max_bytes", path=layout.marker,
                        fix="set it again with `spoolctl init --root PATH --max-size SIZE`")
    return Marker(
        store_id=str(doc.get("store_id", "")),
        created=float(doc.get("created", 0.0)),
        max_bytes=max_bytes,
    )


def write_marker(layout: Layout, marker: Marker) -> None:
    """Atomically (re)write the marker: tmp file, fsync, rename, fsync the root."""
    data = json.dumps(marker.to_json(), indent=2).encode() + b"\n"
    tmp_dir = layout.tmp if layout.tmp.is_dir() else layout.root
    tmp, _, _ = write_tmp(tmp_dir, [data])
    os.replace(tmp, layout.marker)
    fsync_dir(layout.root)


def _mkdir(path: Path) -> bool:
    """Create a 0700 directory; return True if it was created, False if it existed."""
    try:
        os.mkdir(path, DIR_MODE)
        return True
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise RootError("expected a directory", path=path,
                            fix="remove the file or symlink in its place") from None


def ensure_layout(layout: Layout) -> None:
    """Create every directory of the layout (idempotent); fsync only what changed."""
    created_top = [_mkdir(layout.root / name) for name in SUBDIRS]
    for parent in (layout.objects, layout.manifests):
        existing = set(os.listdir(parent))
        for fan in existing.intersection(FANOUT):
            # a fan-out "directory" that is a symlink would send renames outside the root
            if not stat.S_ISDIR(os.lstat(parent / fan).st_mode):
                raise RootError("expected a directory, found a symlink or file", path=parent / fan,
                                fix="remove it; spoolctl recreates the directory")
        missing = [fan for fan in FANOUT if fan not in existing]
        for fan in missing:
            _mkdir(parent / fan)
        if missing:
            fsync_dir(parent)
    if any(created_top):
        fsync_dir(layout.root)


ALLOW_FOREIGN_ENV = "SPOOLCTL_ALLOW_FOREIGN_OWNER"


def check_owner(root: Path, *, allow_foreign_owner: bool) -> None:
    """Refuse a root owned by another user (including root's own use of a user's store):
    acting on it would create files the owner cannot read and mix tenants' data."""
    if allow_foreign_owner or os.environ.get(ALLOW_FOREIGN_ENV) == "1" or os.name != "posix":
        return
    owner = os.lstat(root).st_uid
    if owner != os.geteuid():
        raise RootError(
            f"store root is owned by uid {owner}, not by this user (uid {os.geteuid()})",
            path=root,
            fix=f"run as the owner, or pass --allow-foreign-owner ({ALLOW_FOREIGN_ENV}=1)",
        )


def create_or_adopt(
    root: Path, *, create: bool, max_bytes: int | None, allow_foreign_owner: bool = False
) -> tuple[Layout, Marker]:
    """Open the root at ``root``; create it when ``create`` and it is new or empty.

    Refuses a non-empty directory without a marker and a marker of another schema.
    ``max_bytes`` (when given) is recorded in the marker.
    """
    layout = Layout(root)
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise RootError("store root is not a directory", path=root, fix="choose another --root")
    has_marker = st is not None and os.path.lexists(layout.marker)
    if not has_marker:
        if not create:
            if st is None:
                raise RootError("store root does not exist", path=root,
                                fix="run `spoolctl init --root PATH` first, or check the path")
            read_marker(layout)  # raises the "not a spoolctl store" error
        if st is not None and os.listdir(root):
            raise RootError(
                "refusing to adopt a non-empty directory without a .spoolctl-root marker",
                path=root,
                fix="point --root at an empty or new directory",
            )
        os.makedirs(root, mode=DIR_MODE, exist_ok=True)
        os.chmod(root, DIR_MODE)
        marker = Marker(store_id=secrets.token_hex(8), created=time.time(), max_bytes=max_bytes)
        ensure_layout(layout)
        write_marker(layout, marker)
        return layout, marker
    check_owner(root, allow_foreign_owner=allow_foreign_owner)
    marker = read_marker(layout)
    ensure_layout(layout)
    if max_bytes is not None and max_bytes != marker.max_bytes:
        marker = Marker(store_id=marker.store_id, created=marker.created, max_bytes=max_bytes)
        write_marker(layout, marker)
    return layout, marker
