"""Quarantine: corrupt evidence kept for inspection, with a JSON reason per item.

An item is a directory ``quarantine/<item id>/`` holding ``reason.json`` and
the files moved out of the store (renamed, never copied, so the evidence is
the exact bytes that failed). The reason is written before any file is moved,
so an interrupted quarantine still explains itself. Items are never deleted
automatically; ``spoolctl quarantine purge`` does it on request.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import InvalidIdError, NotFoundError, QuarantineReason
from ..disk import dirfd, faults
from ..disk.fsio import DIR_MODE, ensure_real_dirs, fsync_dir, io_error, read_small, write_tmp

SCHEMA = "spoolctl-quarantine/v1"
REASON_FILE = "reason.json"
_ITEM_RE = re.compile(r"[0-9]{8}T[0-9]{6}Z-[a-z_]{1,32}-[0-9a-f]{8}")


@dataclass(frozen=True)
class QuarantineItem:
    """One quarantined item as found on disk."""

    item_id: str
    path: Path
    reason: str
    detail: str
    time: float
    entry_id: str | None = None
    kind: str | None = None
    files: list[dict[str, Any]] = field(default_factory=list)
    bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "item": self.item_id, "reason": self.reason, "detail": self.detail,
            "time": self.time, "entry_id": self.entry_id, "kind": self.kind,
            "files": self.files, "bytes": self.bytes, "path": str(self.path),
        }

    def files_present(self) -> list[str]:
        """The names in the item's directory now."""
        return dirfd.listdir(self.path)


def validate_item_id(item_id: str) -> str:
    if not isinstance(item_id, str) or not _ITEM_RE.fullmatch(item_id):
        raise InvalidIdError(
            f"invalid quarantine item {str(item_id)[:80]!r}",
            fix="pass an item id as shown by `spoolctl quarantine ls`",
        )
    return item_id


class Quarantine:
    """The quarantine directory of one store."""

    max_depth = dirfd.MAX_TREE_DEPTH  # ``remove`` leaves deeper directories in place

    def __init__(self, directory: Path, tmp_dir: Path):
        self.directory = directory
        self._tmp = tmp_dir

    def add(
        self,
        reason: QuarantineReason,
        detail: str,
        files: list[tuple[Path, str]],
        *,
        entry_id: str | None = None,
        kind: str | None = None,
        checkpoint: Callable[[str], None] | None = None,
    ) -> Path:
        """Move ``files`` ((path, role) pairs) into a new item; missing files are skipped.

        Raises StoreIOError if the item cannot be made (a read-only or full directory)."""
        try:
            return self._add(reason, detail, files, entry_id=entry_id, kind=kind,
                             checkpoint=checkpoint)
        except OSError as exc:
            raise io_error(exc, "quarantining", self.directory) from exc

    def _add(self, reason: QuarantineReason, detail: str, files: list[tuple[Path, str]], *,
             entry_id: str | None, kind: str | None,
             checkpoint: Callable[[str], None] | None) -> Path:
        now = time.time()
        item_id = (
            time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
            + f"-{reason.value}-{secrets.token_hex(4)}"
        )
        item = self.directory / item_id
        ensure_real_dirs(self.directory.parent, self.directory)  # no redirected evidence
        # Created, renamed into and purged through directory descriptors: a quarantine/
        # swapped for a symlink after the check above is never followed.
        dirfd.mkdir(item, DIR_MODE)
        doc = {
            "schema": SCHEMA, "item": item_id, "reason": reason.value, "detail": detail[:500],
            "time": now, "entry_id": entry_id, "kind": kind,
            "files": [{"name": p.name, "role": role, "original": str(p)} for p, role in files],
        }
        tmp, _, _ = write_tmp(self._tmp, [json.dumps(doc, indent=2).encode()])
        dirfd.replace(tmp, item / REASON_FILE)
        for path, _role in files:
            try:
                dirfd.replace(path, item / path.name)
            except FileNotFoundError:
                continue
        if checkpoint:
            checkpoint("quarantine.moved")
        fsync_dir(item)
        fsync_dir(self.directory)
        return item

    def items(self) -> list[QuarantineItem]:
        out = []
        try:
            names = sorted(dirfd.listdir(self.directory))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise io_error(exc, "listing the quarantine", self.directory) from exc
        for name in names:
            if _ITEM_RE.fullmatch(name):
                out.append(self._load(name))
        return out

    def get(self, item_id: str) -> QuarantineItem:
        validate_item_id(item_id)
        if not (self.directory / item_id).is_dir():
            raise NotFoundError(f"no quarantine item {item_id}", path=self.directory,
                                fix="list items with `spoolctl quarantine ls`")
        return self._load(item_id)

    def _load(self, name: str) -> QuarantineItem:
        path = self.directory / name
        size = 0
        try:
            for child in dirfd.scandir(path):
                if child.name != REASON_FILE and child.is_file(follow_symlinks=False):
                    size += child.stat(follow_symlinks=False).st_size
        except OSError:
            pass  # an unreadable item still lists, with what its reason file says
        try:
            # read_small: bounded, never follows a symlink, never blocks on a FIFO
            doc = json.loads(read_small(path / REASON_FILE, 1 << 20))
            if not isinstance(doc, dict):
                raise ValueError
        except (OSError, ValueError, RecursionError):
            doc = {"reason": QuarantineReason.UNKNOWN.value, "detail": "reason.json unreadable"}
        reason = str(doc.get("reason", "unknown"))
        if reason not in {r.value for r in QuarantineReason}:
            reason = QuarantineReason.UNKNOWN.value
        files = [f for f in doc.get("files", []) if isinstance(f, dict)]
        when = doc.get("time")
        return QuarantineItem(
            item_id=name, path=path, reason=reason, detail=str(doc.get("detail", ""))[:500],
            time=float(when) if isinstance(when, (int, float)) and not isinstance(when, bool)
            and math.isfinite(when) else 0.0,
            entry_id=doc.get("entry_id") if isinstance(doc.get("entry_id"), str) else None,
            kind=doc.get("kind") if isinstance(doc.get("kind"), str) else None,
            files=files, bytes=size,
        )

    def remove(self, item: QuarantineItem) -> list[str]:
        """Delete ``item``; returns the directories kept because they lie deeper than
        ``dirfd.MAX_TREE_DEPTH`` (an empty list: the item is gone). StoreIOError."""
        try:
            faults.checkpoint("quarantine.listed")
            kept = dirfd.rmtree(item.path)
            fsync_dir(self.directory)
        except OSError as exc:
            raise io_error(exc, "purging a quarantine item", item.path) from exc
        return kept
