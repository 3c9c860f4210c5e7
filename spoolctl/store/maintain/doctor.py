"""Health checks of a store root, its filesystem and its SQLite files (``spoolctl doctor``).

Each check returns a ``Check``: status (``ok``, ``warn``, ``fail``), what was seen, what to
do. Checks never modify store data (only their own probe files under ``tmp/``); files are
opened without blocking and databases read-only. Per-file and per-row checks are in
``doctor_scan``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sqlite3
import stat
import sys
from pathlib import Path

from ...errors import SpoolError
from ..disk import dirfd
from ..disk.fsio import DIR_MODE, file_kind, full_fsync, probe_o_direct, tmp_name
from ..disk.root import MARKER, SUBDIRS, StorePaths, check_root_path, read_marker, unfinished_init
from ..disk.space import INODE_FIX, INODE_WARN_RATIO, read_only_mount, space_of
from ..disk.sqlite_files import connect_read_only
from ..format.sizes import format_size
from . import doctor_scan
from .doctor_scan import Check, Status


def filesystem_type(path: Path) -> str:
    """The filesystem type of ``path`` (from /proc/self/mounts on Linux; '' if unknown)."""
    if not sys.platform.startswith("linux"):
        return ""
    best, fstype = "", ""
    real = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            mnt = parts[1].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fstype = mnt, parts[2]
    return fstype


# Filesystems whose locking or durability semantics the store cannot rely on.
_NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "fuse.sshfs", "9p", "ceph", "glusterfs"})


def run_checks(root: str | os.PathLike[str]) -> list[Check]:
    """Run every check on ``root``; never raises for a problem it can report."""
    checks: list[Check] = []
    try:
        path = check_root_path(root)
    except SpoolError as exc:
        return [Check("root.path", "fail", exc.message, exc.fix or "")]
    layout = StorePaths(path)
    if not path.is_dir():
        return [Check("root.exists", "fail", f"{path} does not exist",
                      f"create it with `spoolctl init --root {path}`")]
    checks.append(Check("root.path", "ok", f"{path} is absolute and not a symlink"))
    with contextlib.suppress(OSError):
        dirfd.guard(path, os.lstat(path))  # another user's store: nothing under it by name
    marker = None
    try:
        marker = read_marker(layout)
        checks.append(Check("root.marker", "ok", f"{MARKER} present (store {marker.store_id})"))
    except SpoolError as exc:
        if unfinished_init(layout) is not None:
            checks.append(Check("root.marker", "fail",
                                "an unfinished `spoolctl init`: the layout is there, the "
                                f"{MARKER} marker is not",
                                f"run `spoolctl init --root {path}` again to finish it"))
        else:
            checks.append(Check("root.marker", "fail", exc.message, exc.fix or ""))
        return checks
    checks.extend(_permission_checks(layout))
    checks.extend(_filesystem_checks(layout, marker.max_bytes))
    checks.extend(doctor_scan.reserve_check(layout))
    checks.extend(_sqlite_checks(layout))
    checks.extend(doctor_scan.catalog_write_check(layout))
    checks.extend(doctor_scan.row_checks(layout))
    checks.extend(doctor_scan.tree_checks(layout))
    checks.extend(doctor_scan.name_checks(layout))
    checks.extend(doctor_scan.scrub_checks(layout))
    return checks


def _permission_checks(layout: StorePaths) -> list[Check]:
    out = []
    st = os.stat(layout.root)
    uid = os.getuid() if hasattr(os, "getuid") else st.st_uid
    if st.st_uid != uid:
        out.append(Check("root.owner", "warn",
                         f"root is owned by uid {st.st_uid}, you are uid {uid}",
                         "run spoolctl as the user that runs the workers"))
    else:
        out.append(Check("root.owner", "ok", f"owned by uid {uid}"))
    loose = []
    missing = []
    swapped = []
    for name in SUBDIRS:
        p = layout.root / name
        try:
            st_sub = os.lstat(p)
        except FileNotFoundError:
            missing.append(name)
            continue
        if not stat.S_ISDIR(st_sub.st_mode):  # a symlink would lead root's commands away
            swapped.append(f"{name} ({file_kind(st_sub.st_mode)})")
            continue
        mode = stat.S_IMODE(st_sub.st_mode)
        if mode & 0o077:
            loose.append(f"{name} ({oct(mode)})")
    root_mode = stat.S_IMODE(st.st_mode)
    if root_mode & 0o077:
        loose.insert(0, f". ({oct(root_mode)})")
    if missing:
        out.append(Check("root.layout", "fail", f"missing directories: {', '.join(missing)}",
                         "open the store once (e.g. `spoolctl status`) to recreate them"))
    if swapped:
        out.append(Check("root.layout", "fail",
                         f"not a directory: {', '.join(swapped)}",
                         "someone who can write the store replaced a store directory: inspect "
                         "where it points, remove it and open the store as its owner to "
                         "recreate it (no spoolctl command acts through it)"))
    if loose:
        out.append(Check("root.permissions", "warn",
                         f"readable by others: {', '.join(loose)}",
                         f"chmod {oct(DIR_MODE)[2:]} the listed directories (cached prompts "
                         "are sensitive)"))
    else:
        out.append(Check("root.permissions", "ok", "directories are private (mode 0700)"))
    out.append(_parents_check(layout.root, st.st_uid))
    writable = os.access(layout.root, os.W_OK) and os.access(layout.tmp, os.W_OK)
    if writable:
        out.append(Check("root.writable", "ok", "root and tmp/ are writable"))
    elif read_only_mount(layout.root):
        out.append(Check("root.writable", "fail", "root is on a read-only mount",
                         "see fs.read_only: remount read-write"))
    elif st.st_uid != uid and uid != 0:
        out.append(Check("root.writable", "fail", f"root or tmp/ is not writable by uid {uid}: "
                         f"the store belongs to uid {st.st_uid}",
                         f"run spoolctl as uid {st.st_uid} (the store's owner)"))
    else:
        out.append(Check("root.writable", "fail", "root or tmp/ is not writable",
                         f"chown -R {st.st_uid}:{st.st_gid} {layout.root} and chmod 700 the "
                         "store's directories"))
    return out


def _parents_check(root: Path, owner: int) -> Check:
    """``root.parents``: warn if a directory above the root is writable by others (not
    sticky) or owned by anyone but root and the store's owner: they could swap the store."""
    risky = []
    for parent in root.parents:
        try:
            st = os.lstat(parent)
        except OSError:
            continue  # the walk to the root already worked; nothing to judge here
        if st.st_uid not in (0, owner):
            risky.append(f"{parent} (owned by uid {st.st_uid})")
        elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            risky.append(f"{parent} ({oct(stat.S_IMODE(st.st_mode))})")
    if not risky:
        return Check("root.parents", "ok",
                     "no directory above the root is writable by other users")
    return Check("root.parents", "warn", f"writable by others: {', '.join(risky)}",
                 "chmod go-w (or chown) the listed directories: who can write them can "
                 "replace the store")


def _filesystem_checks(layout: StorePaths, max_bytes: int | None) -> list[Check]:
    out = []
    if read_only_mount(layout.root):
        # name the read-only mount itself, not a disk or ownership problem
        out.append(Check("fs.read_only", "fail", "the store's filesystem is mounted read-only: "
                         "read commands show a read-only view, nothing can be written",
                         "remount it read-write (`mount -o remount,rw MOUNTPOINT`) if the store "
                         "should be served or cleaned; if the kernel remounted it after I/O "
                         "errors, check dmesg first"))
    fstype = filesystem_type(layout.root)
    if fstype in _NETWORK_FS:
        out.append(Check("fs.type", "warn", f"{fstype} (network filesystem)",
                         "use a local disk: locks and fsync are unreliable on network mounts"))
    elif fstype in ("tmpfs", "ramfs"):
        out.append(Check("fs.type", "warn", f"{fstype} (memory: the cache competes with "
                         "the engine for RAM and is empty after a reboot)",
                         "use a local disk (NVMe) for the store root"))
    else:
        out.append(Check("fs.type", "ok", fstype or "unknown"))
    usage = shutil.disk_usage(layout.root)
    if max_bytes is None:
        out.append(Check("fs.free", "warn",
                         f"{format_size(usage.free)} free; store has no max size",
                         "set one with `spoolctl init --root PATH --max-size SIZE`"))
    else:
        from ..catalog.index import Catalog

        used = 0
        with contextlib.suppress(sqlite3.DatabaseError, OSError):
            cat = Catalog(layout.state / "catalog.sqlite3", read_only=True)
            try:
                used = cat.totals().bytes
            finally:
                cat.close()
        need = max(max_bytes - used, 0)
        if usage.free < need:
            out.append(Check("fs.free", "warn",
                             f"{format_size(usage.free)} free but the store may grow by "
                             f"{format_size(need)}",
                             "lower --max-size or free disk space"))
        else:
            out.append(Check("fs.free", "ok", f"{format_size(usage.free)} free, store may grow "
                             f"by {format_size(need)}"))
    out.append(_inode_check(layout))
    odirect = probe_o_direct(layout.tmp) if os.access(layout.tmp, os.W_OK) else False
    out.append(Check("fs.o_direct", "ok",
                     "supported" if odirect else "not supported: buffered I/O is used"))
    probe = layout.tmp / f".doctor-{tmp_name()}"
    try:
        # created and removed through tmp/'s descriptor: never through a swapped tmp/
        fd = dirfd.create(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"spoolctl doctor probe\n")
            full_fsync(fd)
        finally:
            os.close(fd)
        out.append(Check("fs.fsync", "ok", "write + fsync works"))
    except OSError as exc:
        fix = {errno.EROFS: "see fs.read_only: remount read-write",
               errno.EACCES: "see root.writable",
               errno.ENOSPC: "free space or inodes (fs.free, fs.inodes): `spoolctl clean`"
               }.get(exc.errno or 0, "check the disk (dmesg)")
        out.append(Check("fs.fsync", "fail", f"write + fsync failed: {os.strerror(exc.errno or 0)}",
                         fix))
    finally:
        with contextlib.suppress(OSError):
            dirfd.unlink(probe)
    return out


def _inode_check(layout: StorePaths) -> Check:
    """``fs.inodes``: fail once commits stop (free inodes under the maintenance headroom),
    warn below ``INODE_WARN_RATIO`` free."""
    space = space_of(layout.root)
    if space is None or space.inodes is None or space.free_inodes is None:
        return Check("fs.inodes", "ok", "no fixed inode count on this filesystem")
    free, total = space.free_inodes, space.inodes
    detail = f"{free} of {total} inodes free ({100.0 * free / total:.1f}%)"
    if space.short_of_inodes:
        return Check("fs.inodes", "fail",
                     f"{detail}: commits stop below {space.inode_headroom} (kept for "
                     f"maintenance), with {format_size(space.free_bytes)} still free",
                     INODE_FIX)
    if free < total * INODE_WARN_RATIO:
        return Check("fs.inodes", "warn",
                     f"{detail}: under {100 * INODE_WARN_RATIO:.0f}%; commits stop at "
                     f"{space.inode_headroom}", INODE_FIX)
    return Check("fs.inodes", "ok", detail)


def _catalog_ddl() -> str:
    from ..catalog.schema import DDL

    return DDL


def _catalog_earlier() -> tuple[str, ...]:
    from ..catalog.schema import DDL_V1

    return (DDL_V1,)  # a catalog not yet migrated to the current schema is not damage


def _scrub_ddl() -> str:
    from .scrub_state import _DDL

    return _DDL


def _auth_ddl() -> str:
    from .auth_requests import _DDL

    return _DDL


# The schema each database must keep to (``sqlite_files.check_schema``).
_SCHEMAS = {"catalog.sqlite3": _catalog_ddl, "scrub.sqlite3": _scrub_ddl,
            "auth_requests.sqlite3": _auth_ddl}


def _sqlite_checks(layout: StorePaths) -> list[Check]:
    out = []
    for name in ("catalog.sqlite3", "scrub.sqlite3", "auth_requests.sqlite3"):
        path = layout.state / name
        if not os.path.lexists(path):
            status: Status = "warn" if name == "catalog.sqlite3" else "ok"
            out.append(Check(f"sqlite.{name}", status, "not created yet",
                             "open the store once to create it" if status == "warn" else ""))
            continue
        try:
            # never follows a link or opens a FIFO; runs nothing planted in the file
            db = connect_read_only(path, timeout=10, ddl=_SCHEMAS[name](),
                                   earlier_ddl=_catalog_earlier()
                                   if name == "catalog.sqlite3" else ())
            try:
                result = str(db.execute("PRAGMA quick_check").fetchone()[0])
                mode = str(db.execute("PRAGMA journal_mode").fetchone()[0])
            finally:
                db.close()
        except sqlite3.DatabaseError as exc:
            result, mode = f"error: {exc}", "?"
        if result == "ok":
            out.append(Check(f"sqlite.{name}", "ok", f"quick_check ok, journal {mode}"))
        else:
            fix = ("the store quarantines and rebuilds a corrupt catalog from manifests on the "
                   "next use" if name == "catalog.sqlite3"
                   else f"remove {path} (progress/queue only; it is recreated)")
            out.append(Check(f"sqlite.{name}", "fail", json.dumps(result)[:200], fix))
    return out
