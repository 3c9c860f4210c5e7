"""Doctor checks that look at every file and row: what this user cannot read or write,
special files where a store keeps regular ones, malformed catalog rows, the catalog's
writability, scrub findings and the full-disk reserve (pure reads; never blocks).

Each function returns ``Check`` records. Permission problems are reported as what the
operator must fix (``chown``/``chmod``/``chattr -i``), never as corruption.
"""

from __future__ import annotations

import errno
import os
import re
import sqlite3
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from ..disk import dirfd
from ..disk.fsio import describe_os_error, file_kind
from ..disk.root import SUBDIRS, StorePaths
from ..disk.sqlite_files import SUFFIXES

MAX_EXAMPLES = 5


Status = Literal["ok", "warn", "fail"]


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _check(name: str, status: Status, detail: str, fix: str = "") -> Check:
    return Check(name, status, detail, fix)


def _examples(paths: list[str]) -> str:
    shown = ", ".join(paths[:MAX_EXAMPLES])
    return shown + (f" and {len(paths) - MAX_EXAMPLES} more" if len(paths) > MAX_EXAMPLES else "")


def _walk(layout: StorePaths, dirs_bad: list[str], owner: int,
          group: int) -> Iterator[dirfd.DirEntryLike]:
    """Every entry under objects/, manifests/ (two levels), tmp/ and state/; directories
    that cannot be listed, or that the store's ``owner`` could not use, go to
    ``dirs_bad``."""
    for top in (layout.objects, layout.manifests, layout.tmp, layout.state):
        try:
            children = dirfd.scandir(top)
        except OSError as exc:
            dirs_bad.append(f"{top} ({describe_os_error(exc)})")
            continue
        for child in children:
            yield child
            if top in (layout.tmp, layout.state) or not child.is_dir(follow_symlinks=False):
                continue
            try:
                why = _owner_cannot(child.stat(follow_symlinks=False), owner, 0o700, group)
            except OSError:
                continue
            if why:
                dirs_bad.append(f"{child.path} ({why})")
                continue
            try:
                yield from dirfd.scandir(child.path)
            except OSError as exc:
                dirs_bad.append(f"{child.path} ({describe_os_error(exc)})")


def _owner_cannot(st: os.stat_result, owner: int, bits: int, group: int) -> str:
    """Why the store's ``owner`` could not use this file or directory with the owner
    permission ``bits`` ('' if it can), judged from ownership and mode (not from who runs
    doctor); another user's file shared through the root's ``group`` is usable."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != owner:
        if st.st_gid == group and not (bits >> 3) & ~mode:
            return ""
        return f"owned by uid {st.st_uid}"
    return f"mode {oct(mode)}" if bits & ~mode else ""


def tree_checks(layout: StorePaths) -> list[Check]:
    """Files and directories of the store that its owner cannot use (owned by another
    user, or without the owner's permission bits), and special files, in its tree."""
    root_st = os.stat(layout.root)
    owner, group = root_st.st_uid, root_st.st_gid
    dirs_bad: list[str] = []
    for name in SUBDIRS:
        p = layout.root / name
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and (why := _owner_cannot(st, owner, 0o700, group)):
            dirs_bad.append(f"{p} ({why})")
    unreadable: list[str] = []
    special: list[str] = []
    for e in _walk(layout, dirs_bad, owner, group):
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            continue
        if not stat.S_ISREG(st.st_mode):
            special.append(f"{e.path} ({file_kind(st.st_mode)})")
        elif why := _owner_cannot(st, owner, 0o600 if "/state/" in e.path else 0o400, group):
            unreadable.append(f"{e.path} ({why})")
    me = os.geteuid() if hasattr(os, "geteuid") else owner
    if me not in (owner, 0) and any("Permission denied" in d for d in dirs_bad):
        # Another user cannot list a private store: that is by design, not a finding.
        return [_check("store.files", "warn",
                       f"not checked: the store is private to uid {owner}, you are uid {me}",
                       f"run `spoolctl doctor` as uid {owner} (e.g. `sudo -u '#{owner}' "
                       "spoolctl doctor --root ROOT`)")]
    chown = f"chown -R {owner}:{group} {layout.root}"
    out: list[Check] = []
    if dirs_bad:
        out.append(_check("store.directories", "fail",
                          f"{len(dirs_bad)} directories the store's owner (uid {owner}) cannot "
                          f"use: {_examples(dirs_bad)}",
                          f"{chown} and chmod 700 them; until then clean and scrub "
                          "skip what is under them"))
    else:
        out.append(_check("store.directories", "ok", "every store directory is usable"))
    if unreadable:
        out.append(_check("store.files", "fail",
                          f"{len(unreadable)} files the store's owner (uid {owner}) cannot open: "
                          f"{_examples(unreadable)}",
                          f"{chown} and chmod 600 them; reads of those entries miss, the "
                          "owner's scrub and clean fail on state/ files, until then"))
    else:
        out.append(_check("store.files", "ok", "every object, manifest and state file is "
                          "usable by the store's owner"))
    if special:
        out.append(_check("store.special_files", "fail",
                          f"{len(special)} special files where regular files belong: "
                          f"{_examples(special)}",
                          "`spoolctl scrub` (or a read) quarantines them; remove any outside "
                          "objects/ and manifests/ by hand"))
    return out


def catalog_write_check(layout: StorePaths) -> list[Check]:
    """Can this user write the catalog (file, -wal/-shm, state/)? Opens for writing
    without writing (an immutable or read-only file refuses the open)."""
    path = layout.state / "catalog.sqlite3"
    problems = []
    if not os.access(layout.state, os.W_OK | os.X_OK):
        problems.append(f"{layout.state} is not writable")
    for suffix in SUFFIXES:
        p = path.with_name(path.name + suffix)
        try:
            fd = dirfd.open_file(p, os.O_WRONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            continue
        except OSError as exc:
            why = "immutable or append-only (chattr)" if exc.errno == errno.EPERM else \
                describe_os_error(exc)
            problems.append(f"{p.name}: {why}")
            continue
        os.close(fd)
    if not problems:
        return [_check("catalog.writable", "ok", "the catalog can be written")]
    from ..disk.space import read_only_mount

    if read_only_mount(layout.root):
        return [_check("catalog.writable", "fail", "; ".join(problems),
                       "see fs.read_only: remount read-write; until then only read-only "
                       "commands work")]
    st = os.stat(layout.root)
    me = os.geteuid() if hasattr(os, "geteuid") else st.st_uid
    if me not in (st.st_uid, 0):
        return [_check("catalog.writable", "fail", "; ".join(problems),
                       f"the store belongs to uid {st.st_uid}: run write commands as that "
                       "user; read commands work for you as a read-only view")]
    return [_check("catalog.writable", "fail", "; ".join(problems),
                   "make the catalog writable by the store's owner (chattr -i, chmod 600, "
                   f"chown {st.st_uid}:{st.st_gid}); until then only read-only commands work")]


def row_checks(layout: StorePaths) -> list[Check]:
    """Malformed catalog rows (read-only; a full scan)."""
    from ..catalog.index import Catalog

    path = layout.state / "catalog.sqlite3"
    if not path.exists():
        return []
    try:
        cat = Catalog(path, read_only=True)
    except (sqlite3.DatabaseError, OSError):
        return []  # the sqlite checks already report an unreadable catalog
    try:
        count = cat.malformed_count()
        bad = cat.malformed(MAX_EXAMPLES) if count else []
    except sqlite3.DatabaseError:
        return []
    finally:
        cat.close()
    if not count:
        return [_check("catalog.rows", "ok", "every catalog row is well formed")]
    from ..catalog.rows import shown_id

    shown = "; ".join(f"{shown_id(e)[:16]}: {why}" for e, why in bad)
    return [_check("catalog.rows", "fail", f"{count} malformed catalog rows ({shown})",
                   "`spoolctl clean --orphans` re-indexes them from their manifests; until "
                   "then clean, status and metrics skip them")]


def scrub_checks(layout: StorePaths) -> list[Check]:
    """Entries the last scrub could not read (the scrub moved on; they need a fix)."""
    from .scrub_state import SCRUB_DB, UNREADABLE, ScrubState

    path = layout.state / SCRUB_DB
    if not path.exists():
        return []
    try:
        state = ScrubState(path, read_only=True)
    except (sqlite3.DatabaseError, OSError):
        return []
    try:
        summary = state.summary()
        cycle = summary.current_cycle or summary.last_cycle
        count = cycle.unreadable if cycle else 0
        found = state.entry_ids_found(cycle.cycle_id if cycle else -1, UNREADABLE,
                                      MAX_EXAMPLES)
    except sqlite3.DatabaseError:
        return []
    finally:
        state.close()
    if not count:
        return []
    ids = ", ".join(entry_id[:16] for entry_id in found)
    return [_check("scrub.unreadable", "fail",
                   f"the scrub could not read {count} entries ({ids})",
                   "fix the permissions `store.files` names; otherwise the disk failed the "
                   "reads (I/O errors: check dmesg and the drive's health, `smartctl -a`). "
                   "An I/O error is not proof of corruption: nothing was quarantined, the "
                   "entries are misses while they fail and the next scrub cycle verifies "
                   "them again")]


def reserve_check(layout: StorePaths) -> list[Check]:
    from ..disk.reserve import Reserve

    reserve = Reserve(layout.state)
    have, want = reserve.count, reserve.pieces
    if want == 0:
        return [_check("fs.reserve", "ok", "the filesystem is too small for a full-disk "
                       "reserve (under 4 MiB)")]
    if have >= want:
        return [_check("fs.reserve", "ok",
                       f"{have * reserve.piece_bytes >> 10} KiB reserved so a full disk can "
                       "be shed")]
    return [_check("fs.reserve", "warn",
                   f"{have} of {want} reserve pieces in place: on a full disk, "
                   "cleaning may have to wait for free space",
                   "free a few MiB; the store re-creates state/reserve.* at its next open")]


_FAN = re.compile(r"[0-9a-f]{2}")
_IN_FAN = {"objects": re.compile(r"[0-9a-f]{64}\.obj"),
           "manifests": re.compile(r"[0-9a-f]{64}\.json")}


def shown_name(path: str) -> str:
    """``path`` as text that always prints: non-UTF-8 bytes shown as ``\\xff``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _names(directory: Path) -> list[dirfd.DirEntryLike]:
    try:
        return dirfd.scandir(directory)
    except OSError:
        return []  # unreadable directories are store.directories' finding


def name_checks(layout: StorePaths) -> list[Check]:
    """Names spoolctl never writes: in ``objects/<aa>/`` and ``manifests/<aa>/`` anything
    but that fan-out's names, and anywhere in the tree a name that is not UTF-8."""
    odd: list[str] = []
    for e in _names(layout.root):
        if not _utf8(e.name):
            odd.append(e.path)
    for area, pattern in _IN_FAN.items():
        for fan in _names(layout.root / area):
            if not _FAN.fullmatch(fan.name) or not fan.is_dir(follow_symlinks=False):
                odd.append(fan.path)
                continue
            odd += [e.path for e in _names(Path(fan.path))
                    if not pattern.fullmatch(e.name) or not e.name.startswith(fan.name)]
    for area in ("state", "tmp", "quarantine"):
        for e in _names(layout.root / area):
            if not _utf8(e.name):
                odd.append(e.path)
            elif area == "quarantine" and e.is_dir(follow_symlinks=False):
                odd += [i.path for i in _names(Path(e.path)) if not _utf8(i.name)]
    if not odd:
        return [_check("store.names", "ok", "every name in the store is one spoolctl writes")]
    return [_check("store.names", "warn",
                   f"{len(odd)} files spoolctl does not write: "
                   f"{_examples(sorted(shown_name(p) for p in odd))}",
                   "move them out of the store; they are never read, and no cleanup deletes "
                   "what it does not know")]
