"""Several drives per host: which drive a chunk lives on, and what names a drive.

A host with several NVMe drives gives the connector one base root per drive. Each chunk
has one home drive, chosen by rendezvous (highest random weight) hashing of the chunk key
over the drives' ids (``home``): every drive scores the key, the highest score wins.
What the rule guarantees:

* **Stable.** The home depends only on the key and the *set* of drive ids, never on the
  order the roots are listed in: reordering the config moves nothing.
* **Minimal movement.** Removing a drive moves only the chunks that lived on it (each to
  its runner-up); adding one moves only the chunks it now wins (about 1/n of them).
* **Even.** Keys are chain hashes (uniform), so each drive gets about 1/n of the chunks.

A drive's id comes from the drive, not from its position in a list: ``drive_id(root)``
reads ``<root>/.spoolctl-drive`` (created once, atomically, with a random id, the first
time the connector uses the root). A drive moved to another mount point keeps its chunks;
a fresh (replaced) drive gets a new id, and only its share of chunks starts cold.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
from collections.abc import Collection, Sequence
from pathlib import Path

from blake3 import blake3

from spoolctl.errors import ConfigError

from ..deployment.description import Unreadable, read_bounded

MARKER = ".spoolctl-drive"
SCHEMA = "spoolctl-drive/v1"
_ID_HEX = 32
# What ``link`` fails with where a filesystem has no hard links (EROFS: mfusepy's default).
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS,
                            errno.EMLINK, errno.EROFS})
_LIMIT = 4096


def score(drive: str, key: str) -> int:
    """The weight of ``drive`` for chunk ``key`` (64 bits of a keyed hash of both)."""
    digest = blake3(f"{drive}\0{key}".encode(), max_threads=1).digest(length=8)
    return int.from_bytes(digest, "big")


def home(key: str, drives: Sequence[str]) -> str:
    """The drive id chunk ``key`` lives on: the highest score; ties (never seen with 64-bit
    scores) go to the smaller id, so the answer never depends on the list's order."""
    if not drives:
        raise ValueError("no drives")
    return max(drives, key=lambda d: (score(d, key), d))


def ranked(key: str, drives: Sequence[str]) -> list[str]:
    """Every drive ordered by its score for ``key``, home first (the runner-up is where the
    chunk goes if its home leaves the set)."""
    return sorted(drives, key=lambda d: (score(d, key), d), reverse=True)


def route(key: str, drives: Sequence[str], up: Collection[str]) -> str | None:
    """The drive chunk ``key`` is *written* to: the first of ``ranked(key, drives)`` that is
    up (its home while the home is up, else its runner-up); None when no
    drive is up. Where a chunk *is* is read from the drives, never computed."""
    return next((d for d in ranked(key, drives) if d in up), None)


def _refuse(root: Path, why: str) -> ConfigError:
    return ConfigError(f"{root / MARKER} {why}", path=str(root / MARKER),
                       fix="remove it; the connector writes a new drive id at its next start "
                           "(the chunks on this drive are then misses until stored again)")


def read_drive_id(root: str | Path) -> str | None:
    """The id recorded in ``<root>/.spoolctl-drive``; None when there is none. ConfigError
    when it is a link, not a regular file, or not a drive marker (never blocks on a FIFO)."""
    root = Path(root)
    try:
        data = read_bounded(root / MARKER, _LIMIT)
    except Unreadable as exc:
        raise _refuse(root, str(exc)) from None
    if data is None:
        return None
    try:
        doc = json.loads(data) if len(data) <= _LIMIT else None
    except (ValueError, RecursionError):
        doc = None
    drive = doc.get("drive_id") if isinstance(doc, dict) and doc.get("schema") == SCHEMA \
        else None
    if not isinstance(drive, str) or len(drive) != _ID_HEX or \
            any(c not in "0123456789abcdef" for c in drive):
        raise _refuse(root, "is not a drive marker")
    return drive


def drive_id(root: str | Path) -> str:
    """The id of the drive at base root ``root``, recorded there on first use (created with
    O_EXCL, so two processes starting together agree on the first one written)."""
    root = Path(root)
    found = read_drive_id(root)
    if found is not None:
        return found
    doc = {"schema": SCHEMA, "drive_id": secrets.token_hex(_ID_HEX // 2)}
    tmp = root / f"{MARKER}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                 0o644)
    try:
        os.write(fd, json.dumps(doc).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, root / MARKER)  # fails if another process recorded one meanwhile
    except FileExistsError:
        pass
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        # A filesystem without hard links (vfat, many FUSE and SMB mounts) can never hold
        # the marker: say so once, with the fix, instead of an errno on every retry.
        raise ConfigError(f"{root} is on a filesystem without hard links ({exc.strerror}), "
                          "which the drive marker needs; put this drive root on a local "
                          "filesystem such as ext4 or xfs, or leave it out of the roots",
                          path=str(root)) from None
    finally:
        os.unlink(tmp)
    dirfd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)
    found = read_drive_id(root)
    assert found is not None
    return found
