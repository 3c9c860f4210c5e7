"""Committing one entry, manifest-last.

The sequence (each step durable before the next; see docs/format.md):

1. each object is staged, fsynced and renamed to ``objects/<aa>/<digest>.obj``
   (content-addressed: an identical object already there is reused, a damaged one is
   quarantined and replaced);
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
import os
import sqlite3
import stat
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import CapacityError, ManifestError, QuarantineReason, SpoolError
from .fsio import hash_file, io_error, read_manifest
from .gc import LOW_WATERMARK
from .manifest import Manifest, ObjectRef, encode
from .publish import Publisher

if TYPE_CHECKING:
    from .store import Store

Payload = bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview]


class Committer:
    """Commits entries into one store through ``publisher`` (see the module docstring)."""

    def __init__(self, store: Store, publisher: Publisher):
        self._store = store
        self._publisher = publisher

    def check_fits(self, size: int) -> None:
        """CapacityError if an entry of ``size`` bytes exceeds the store's low watermark."""
        max_bytes = self._store.max_bytes
        if max_bytes is not None and size > max_bytes * LOW_WATERMARK:
            raise CapacityError(
                f"entry of {size} bytes does not fit the store (max {max_bytes})",
                path=self._store.root,
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
        self.check_fits(sum(len(memoryview(p).cast("B")) for p in objects.values()
                            if isinstance(p, (bytes, bytearray, memoryview))))
        refs = tuple(self.publish_object(name, payload) for name, payload in objects.items())
        self.check_fits(sum(r.size for r in refs))
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

    def publish_object(self, name: str, payload: Payload) -> ObjectRef:
        """Stage ``payload`` and make it ``objects/<aa>/<digest>.obj`` (step 1)."""
        chunks = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else payload
        staged = self._publisher.stage(chunks, what="object")
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


def _existing_object_ok(path: Path, digest: str, size: int) -> bool:
    """True if the object already at ``path`` is a regular file with exactly this content."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
        return hash_file(path) == (digest, size)
    except OSError:
        return False
