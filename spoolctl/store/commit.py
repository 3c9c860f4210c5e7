"""Committing one entry, manifest-last.

The sequence (each step durable before the next; see docs/format.md):

0. every object is staged in ``tmp/`` (written, hashed, fsynced) *before any is
   published*, each bounded while it streams by what is left of the entry's size budget
   (90% of the store's max size): a put that is too large, or whose stream yields
   something that is not bytes, fails in ``tmp/`` and leaves nothing behind;
1. each staged object is renamed to ``objects/<aa>/<digest>.obj`` (content-addressed: an
   identical object already there is reused, a damaged one is quarantined and replaced);
2. the catalog records the commit's *intent* (a pending row pinning those objects);
3. the manifest is staged and renamed to ``manifests/<aa>/<entry_id>.json``;
4. the catalog row is marked committed (and a superseded entry released).

A crash before 3 leaves only orphans and a pending row, which recovery rolls back; a
crash after 3 leaves a complete entry, which recovery marks committed. An error before
3 rolls the intent back at once. The caller (``Store.put``) holds the maintenance lock
shared, so no deletion runs meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import stat
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import CapacityError, ConfigError, ManifestError, QuarantineReason, SpoolError
from .fsio import SizeLimitExceeded, hash_file, io_error, read_manifest
from .gc import LOW_WATERMARK
from .inputs import is_bytes_like, payload_size
from .manifest import Manifest, ObjectRef, encode
from .publish import Publisher, Staged
from .reserve import HEADROOM_BYTES, headroom_ok

if TYPE_CHECKING:
    from .store import Store

Payload = bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview]


class Committer:
    """Commits entries into one store through ``publisher`` (see the module docstring)."""

    def __init__(self, store: Store, publisher: Publisher):
        self._store = store
        self._publisher = publisher

    def budget(self) -> int | None:
        """The most bytes one entry may hold: 90% of the max size (None: unbounded)."""
        max_bytes = self._store.max_bytes
        return None if max_bytes is None else int(max_bytes * LOW_WATERMARK)

    def check_fits(self, size: int) -> None:
        """CapacityError if an entry of ``size`` bytes exceeds the store's low watermark."""
        budget = self.budget()
        if budget is not None and size > budget:
            raise self._too_large(f"{size} bytes")

    def _too_large(self, size: str) -> CapacityError:
        return CapacityError(
            f"entry of {size} does not fit the store (max {self._store.max_bytes}; one entry "
            "may take at most 90% of it)", path=self._store.root,
            fix="raise the store's max size (`spoolctl init --max-size`)")

    def commit(self, entry_id: str, *, kind: str, namespace: str, key: str,
               objects: Mapping[str, Payload], meta: Mapping[str, Any] | None,
               index: Mapping[str, Any] | None, supersedes: str | None) -> Manifest:
        """Commit one entry (validated by the caller) and return its manifest; an entry
        already committed under ``entry_id`` is returned as is (revived if released)."""
        store = self._store
        existing = self.existing(entry_id, supersedes)
        if existing is not None:
            return existing
        self.check_fits(sum(payload_size(p) for p in objects.values() if is_bytes_like(p)))
        if not headroom_ok(store.layout.tmp):
            # Leave the filesystem's last megabyte to maintenance (reserve.py): a commit
            # must never take the room that lets `spoolctl clean` shed load.
            raise store_full(store.layout.tmp)
        refs = self.publish_objects(objects)
        manifest = Manifest.new(
            kind=kind, namespace=namespace, key=key, created=time.time(), objects=refs,
            meta=meta, index=index, supersedes=supersedes,
        )
        data = encode(manifest)
        store.catalog.record_intent(manifest, len(data), time.time())
        final = store.layout.manifest_path(entry_id)
        published: list[Path] = []
        try:
            store.checkpoint("catalog.intent")
            staged = self._publisher.stage([data], what="manifest")
            with self._publisher.failing(staged, "publishing the manifest", final):
                self._publisher.publish(staged.tmp, final, what="manifest", placed=published)
            store.catalog.mark_committed(entry_id, supersedes)
            store.checkpoint("catalog.committed")
        except (OSError, SpoolError, sqlite3.DatabaseError) as exc:
            if not published:
                # Roll back the intent so the row does not pin the objects; they become
                # orphans, reclaimed by age. Best effort: recovery does the same.
                with contextlib.suppress(sqlite3.DatabaseError):
                    store.catalog.delete_entries([entry_id])
            if isinstance(exc, OSError):
                raise io_error(exc, "committing an entry", final) from exc
            raise
        return manifest

    def existing(self, entry_id: str, supersedes: str | None) -> Manifest | None:
        """The already-committed entry ``entry_id`` (revived if released), or None."""
        store = self._store
        catalog = store.catalog
        row = catalog.get(entry_id)
        path = store.layout.manifest_path(entry_id)
        if (row is not None and row.state == "committed") or (row is None and path.exists()):
            try:
                manifest = read_manifest(path, entry_id)
            except FileNotFoundError:
                return None
            except ManifestError as exc:
                store.quarantine_entry(entry_id, exc.reason, exc.message)
                return None
            if not all(store.layout.object_path(r.digest).exists() for r in manifest.objects):
                return None  # an object was lost: rewrite the entry
            if row is None:
                catalog.index_manifest(manifest, path.stat().st_size, last_access=time.time())
            elif row.hint != "retain":
                catalog.set_hint(entry_id, "retain")
            if supersedes:
                catalog.set_hint(supersedes, "release")
            return manifest
        return None

    def publish_objects(self, objects: Mapping[str, Payload]) -> tuple[ObjectRef, ...]:
        """Stage every object (step 0), then publish each (step 1). On any error every
        staged temp file is removed: nothing of a failed put stays on disk but objects it
        already published (only after every object was staged and checked)."""
        budget = self.budget()
        staged: list[tuple[str, Staged]] = []
        try:
            for name, payload in objects.items():
                left = None if budget is None else budget - sum(st.size for _, st in staged)
                staged.append((name, self._stage(name, payload, left)))
            return tuple(self._place(name, st) for name, st in staged)
        finally:
            for _, st in staged:
                self._publisher.discard(st)  # no-op for a file already renamed

    def _stage(self, name: str, payload: Payload, left: int | None) -> Staged:
        chunks = [payload] if is_bytes_like(payload) else payload
        try:
            return self._publisher.stage(chunks, what="object", limit=left)
        except SizeLimitExceeded:
            raise self._too_large(f"more than {self.budget()} bytes (object {name} was "
                                  "still streaming)") from None
        except TypeError as exc:
            raise ConfigError(f"object {name}: a streamed chunk is not bytes-like ({exc})",
                              fix="yield bytes, bytearray or memoryview chunks") from None

    def publish_object(self, name: str, payload: Payload) -> ObjectRef:
        """Stage ``payload`` and make it ``objects/<aa>/<digest>.obj`` (steps 0 and 1)."""
        staged = self._stage(name, payload, self.budget())
        try:
            return self._place(name, staged)
        finally:
            self._publisher.discard(staged)

    def _place(self, name: str, staged: Staged) -> ObjectRef:
        """Publish one staged object (step 1)."""
        ref = ObjectRef(name=name, digest=staged.digest, size=staged.size)
        final = self._store.layout.object_path(staged.digest)
        with self._publisher.failing(staged, "publishing an object", final):
            self._publisher.check_dirs(final.parent)
            if os.path.lexists(final):
                if _existing_object_ok(final, staged.digest, staged.size):
                    self._publisher.discard(staged)  # content-addressed: already stored
                    return ref
                self._store.quarantine_files(None, QuarantineReason.OBJECT_COLLISION,
                                             "existing object did not match its name; replaced",
                                             [(final, "object")])
            self._publisher.publish(staged.tmp, final, what="object")
        return ref


def store_full(where: Path) -> SpoolError:
    """The error of a commit refused because the filesystem is (nearly) full."""
    from .errors import StoreIOError

    return StoreIOError(f"committing an entry refused: No space left on device (less than "
                        f"{HEADROOM_BYTES >> 10} KiB free: that room is kept for maintenance)",
                        path=where,
                        fix="free disk space: `spoolctl clean --released` and lowering the "
                            "max size work on a full disk (docs/runbook.md)",
                        errno=errno.ENOSPC)


def _existing_object_ok(path: Path, digest: str, size: int) -> bool:
    """True if the object already at ``path`` is a regular file with exactly this content."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
        return hash_file(path) == (digest, size)
    except OSError:
        return False
