"""The spool store: commit, lookup, verified read, hints, capacity, recovery.

Contract (see docs/format.md for the on-disk format):

* ``put`` publishes objects, then the manifest, then marks the catalog row
  committed (manifest-last). A crash at any step leaves the entry complete or
  invisible; leftovers are reclaimed by ``clean_tmp`` / ``collect_orphans``.
* ``read`` returns payload bytes only after their digest matched in the same
  pass. Any defect quarantines the entry and raises ``CorruptionError``;
  callers treat it as a miss.
* Deletion (``clean_released``, ``enforce_capacity``, ``collect_orphans``)
  holds the maintenance lock exclusively; commits hold it shared. Deletion
  removes manifests first, then catalog rows, then unreferenced objects, so a
  concurrent reader sees either the whole entry or a clean miss.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import sqlite3
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from . import faults
from .catalog import Catalog, CatalogRow, Totals
from .errors import (
    BusyError,
    CapacityError,
    ConfigError,
    CorruptionError,
    InvalidIdError,
    ManifestError,
    NotFoundError,
    QuarantineReason,
    SpoolError,
    StoreIOError,
)
from .fsio import (
    ensure_real_dirs,
    fsync_dir,
    hash_file,
    io_error,
    read_small,
    read_verified,
    unlink_many,
    write_tmp,
)
from .keys import (
    entry_id_for,
    validate_entry_id,
    validate_entry_prefix,
    validate_object_name,
)
from .locks import OwnerInfo, OwnerLease, hold_gated, read_owner, try_hold_gated
from .manifest import MAX_MANIFEST_BYTES, Manifest, ObjectRef, canonical_json, decode, encode
from .quarantine import Quarantine, QuarantineItem
from .root import KNOWN_TOP, Layout, Marker, check_root_path, create_or_adopt

log = logging.getLogger("spoolctl.store")

Payload = bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview]
T = TypeVar("T")

LOW_WATERMARK = 0.9
DEFAULT_LOCK_TIMEOUT = 60.0
DEFAULT_ORPHAN_AGE = 3600.0
LIVE_WRITER_GRACE = 3600.0
DELETE_BATCH = 1000
# Bounded work done inline after a commit; the rest is left to the next pass/cron.
COMMIT_EVICTION_BUDGET = 256
_TMP_RE = re.compile(r"([0-9]+)-[0-9a-f]{16}\.part")
_OBJ_RE = re.compile(r"[0-9a-f]{64}\.obj")
_MAN_RE = re.compile(r"[0-9a-f]{64}\.json")


@dataclass
class DeleteReport:
    """What a maintenance pass deleted (or would delete, under ``dry_run``)."""

    entries: int = 0
    objects: int = 0
    bytes: int = 0
    files: int = 0
    dry_run: bool = False
    entry_ids: list[str] = field(default_factory=list)

    def add(self, other: DeleteReport) -> None:
        self.entries += other.entries
        self.objects += other.objects
        self.bytes += other.bytes
        self.files += other.files
        self.entry_ids.extend(other.entry_ids)

    def to_json(self) -> dict:
        return {
            "entries": self.entries, "objects": self.objects, "bytes": self.bytes,
            "files": self.files, "dry_run": self.dry_run,
        }


@dataclass
class ReconcileReport:
    """What ``collect_orphans`` found and did."""

    indexed: int = 0
    dropped_rows: int = 0
    quarantined: int = 0
    orphan_objects: DeleteReport = field(default_factory=DeleteReport)
    young_orphans: int = 0
    unknown_files: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "indexed": self.indexed, "dropped_rows": self.dropped_rows,
            "quarantined": self.quarantined, "orphans": self.orphan_objects.to_json(),
            "young_orphans": self.young_orphans, "unknown_files": self.unknown_files[:100],
        }


def _is_catalog_corruption(exc: sqlite3.DatabaseError) -> bool:
    text = str(exc).lower()
    transient = ("locked", "busy", "disk i/o", "disk is full", "readonly", "unable to open")
    return not any(word in text for word in transient)


class Store:
    """One store root. Thread-safe; many processes may open the same root.

    Open with ``Store.open``; use as a context manager or call ``close()``.
    """

    def __init__(self, layout: Layout, marker: Marker, *, lock_timeout: float):
        self.layout = layout
        self.marker = marker
        self.lock_timeout = lock_timeout
        self.quarantine = Quarantine(layout.quarantine, layout.tmp)
        self.unknown_files: list[str] = []
        self._catalog: Catalog | None = None
        self.checkpoint = faults.checkpoint

    # -- opening --------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str],
        *,
        create: bool = False,
        max_bytes: int | None = None,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        allow_foreign_owner: bool = False,
    ) -> Store:
        """Open (or with ``create`` make) the store at ``root``.

        Refuses relative or symlinked roots, non-empty unmarked directories,
        foreign markers and (unless ``allow_foreign_owner``) roots owned by another
        user with a RootError. ``max_bytes`` is recorded in the marker.
        Removes temp files abandoned by dead writers, resolves interrupted commits
        when no other process is busy, and reports unknown files in ``unknown_files``.
        """
        path = check_root_path(root)
        try:
            layout, marker = create_or_adopt(path, create=create, max_bytes=max_bytes,
                                             allow_foreign_owner=allow_foreign_owner)
        except PermissionError as exc:
            raise ConfigError("permission denied opening the store", path=exc.filename or path,
                              fix="run as the store's owner or fix its permissions") from None
        store = cls(layout, marker, lock_timeout=lock_timeout)
        store._open_catalog()
        store._remove_abandoned_tmp()
        with try_hold_gated(store._maint_lock, store._maint_gate) as alone:
            if alone:
                try:
                    store._resolve_pending()
                except sqlite3.DatabaseError as exc:  # left for the next maintenance pass
                    log.warning("could not resolve interrupted commits: %s", exc)
        store.unknown_files = store._scan_top_level()
        for name in store.unknown_files:
            log.warning("unknown file in store root %s: %s", layout.root, name)
        return store

    @property
    def root(self) -> Path:
        return self.layout.root

    @property
    def max_bytes(self) -> int | None:
        return self.marker.max_bytes

    @property
    def _maint_gate(self) -> Path:
        return self.layout.state / "maintenance.gate"

    def _maintenance(self, *, exclusive: bool, timeout: float | None, what: str):
        """The maintenance lock (shared: commits; exclusive: deletions), writer-preferring."""
        return hold_gated(self._maint_lock, self._maint_gate, exclusive=exclusive,
                          timeout=timeout, what=what)

    @property
    def _maint_lock(self) -> Path:
        return self.layout.state / "maintenance.lock"

    @property
    def catalog(self) -> Catalog:
        assert self._catalog is not None, "store is closed"
        return self._catalog

    def close(self) -> None:
        if self._catalog is not None:
            self._catalog.close()
            self._catalog = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- catalog health ----------------------------------------------------------------

    @property
    def _catalog_path(self) -> Path:
        return self.layout.state / "catalog.sqlite3"

    def _open_catalog(self) -> None:
        fresh = not self._catalog_path.exists()
        try:
            self._catalog = Catalog(self._catalog_path)
        except sqlite3.DatabaseError as exc:
            if not _is_catalog_corruption(exc):
                raise self._sqlite_error(exc) from None
            self._rebuild_catalog(f"catalog unreadable: {exc}")
            return
        if fresh and self._has_manifests():
            self._rebuild_catalog(None)

    def _has_manifests(self) -> bool:
        for fan in os.scandir(self.layout.manifests):
            if fan.is_dir(follow_symlinks=False):
                with os.scandir(fan.path) as it:
                    if any(_MAN_RE.fullmatch(e.name) for e in it):
                        return True
        return False

    def _sqlite_error(self, exc: sqlite3.DatabaseError) -> SpoolError:
        text = str(exc).lower()
        if "locked" in text or "busy" in text:
            return BusyError("catalog is locked by another process", path=self._catalog_path,
                             fix="retry; if it persists check `spoolctl status` for the owner")
        if "full" in text:
            return StoreIOError("catalog write failed: No space left on device",
                                path=self._catalog_path,
                                fix="free disk space or lower the store's max size")
        return StoreIOError(f"catalog I/O failed: {exc}", path=self._catalog_path,
                            fix="check free space and the disk (`spoolctl doctor`)")

    def _guarded(self, fn: Callable[[], T]) -> T:
        """Run ``fn``; if the catalog turns out corrupt, quarantine it, rebuild, retry once."""
        try:
            return fn()
        except sqlite3.DatabaseError as exc:
            if not _is_catalog_corruption(exc):
                raise self._sqlite_error(exc) from None
            self._rebuild_catalog(f"catalog corrupt: {exc}")
        try:
            return fn()
        except sqlite3.DatabaseError as exc:
            raise self._sqlite_error(exc) from None

    def _rebuild_catalog(self, why: str | None) -> None:
        """Quarantine the catalog (if ``why``) and rebuild it from manifests.

        Runs under the exclusive maintenance lock so two processes never rebuild
        at once; every hint comes back as retain (safe: nothing is lost).
        """
        with self._maintenance(exclusive=True, timeout=self.lock_timeout,
                  what="rebuilding the catalog"):
            if self._catalog is not None:
                self._catalog.close()
                self._catalog = None
            if why is not None:
                files = [
                    (self.layout.state / f"catalog.sqlite3{suffix}", "catalog")
                    for suffix in ("", "-wal", "-shm")
                ]
                self.quarantine.add(QuarantineReason.CATALOG, why, files)
                log.warning("catalog quarantined and rebuilt: %s", why)
            self._catalog = Catalog(self._catalog_path)
            for path in self._iter_manifest_files():
                manifest = self._decode_manifest_file(path)
                if manifest is not None:
                    self._catalog.index_manifest(manifest, path.stat().st_size)

    def _iter_manifest_files(self) -> Iterable[Path]:
        for fan in sorted(os.scandir(self.layout.manifests), key=lambda e: e.name):
            if not fan.is_dir(follow_symlinks=False):
                continue
            with os.scandir(fan.path) as it:
                for e in it:
                    if _MAN_RE.fullmatch(e.name) and e.is_file(follow_symlinks=False):
                        yield Path(e.path)

    def _decode_manifest_file(self, path: Path) -> Manifest | None:
        """Decode a manifest found by a scan; quarantine it (and return None) if bad."""
        entry_id = path.name[:-5]
        try:
            return self._load_manifest_file(entry_id, path)
        except ManifestError as exc:
            self._quarantine_files(entry_id, exc.reason, exc.message, [(path, "manifest")])
            return None
        except FileNotFoundError:
            return None

    # -- commit -----------------------------------------------------------------------

    def put(
        self,
        *,
        kind: str,
        namespace: str,
        key: str,
        objects: Mapping[str, Payload],
        meta: Mapping[str, Any] | None = None,
        index: Mapping[str, Any] | None = None,
        supersedes: str | None = None,
        evict: bool = True,
    ) -> Manifest:
        """Commit one entry (manifest-last) and return its manifest.

        If the entry already exists it is returned as is (and revived if it was
        released): a key names one content. ``supersedes`` is recorded and that
        entry released in the same catalog transaction. Raises StoreIOError on
        a disk failure (nothing partial is visible), CapacityError if the entry
        alone exceeds the store's low watermark, BusyError on lock timeout.
        ``evict=False`` skips the commit-time capacity check, for an owner (the vLLM
        connector) that must withdraw entries from its peers before deleting them.
        """
        entry_id = entry_id_for(kind, namespace, key)
        for name in objects:
            validate_object_name(name)
        if supersedes is not None:
            validate_entry_id(supersedes)
        manifest = self._guarded(lambda: self._put_once(
            entry_id, kind, namespace, key, objects, meta, index, supersedes))
        if evict and self.max_bytes is not None and self.totals().bytes > self.max_bytes:
            with contextlib.suppress(BusyError):
                self.enforce_capacity(budget=COMMIT_EVICTION_BUDGET, wait=False)
        return manifest

    def _put_once(self, entry_id, kind, namespace, key, objects, meta, index, supersedes):
        with self._maintenance(exclusive=False, timeout=self.lock_timeout,
                  what="committing an entry"):
            existing = self._existing_for_put(entry_id, supersedes)
            if existing is not None:
                return existing
            known = [len(memoryview(p).cast("B")) for p in objects.values()
                     if isinstance(p, (bytes, bytearray, memoryview))]
            if self.max_bytes is not None and sum(known) > self.max_bytes * LOW_WATERMARK:
                raise CapacityError(
                    f"entry of {sum(known)} bytes does not fit the store (max {self.max_bytes})",
                    path=self.root, fix="raise the store's max size (`spoolctl init --max-size`)")
            refs = tuple(self._publish_object(name, payload) for name, payload in objects.items())
            size = sum(r.size for r in refs)
            if self.max_bytes is not None and size > self.max_bytes * LOW_WATERMARK:
                raise CapacityError(
                    f"entry of {size} bytes does not fit the store (max {self.max_bytes})",
                    path=self.root, fix="raise the store's max size (`spoolctl init --max-size`)")
            manifest = Manifest.new(
                kind=kind, namespace=namespace, key=key, created=time.time(), objects=refs,
                meta=meta, index=index, supersedes=supersedes,
            )
            data = encode(manifest)
            self.catalog.record_intent(manifest, len(data), time.time())
            final = self.layout.manifest_path(entry_id)
            published = False
            try:
                self.checkpoint("catalog.intent")
                tmp, _, _ = write_tmp(self.layout.tmp, [data])
                try:
                    self.checkpoint("manifest.tmp_written")
                    ensure_real_dirs(self.root, final.parent)
                    os.replace(tmp, final)
                    published = True
                    self.checkpoint("manifest.published")
                    fsync_dir(final.parent)
                    self.checkpoint("manifest.dir_fsynced")
                except OSError as exc:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise io_error(exc, "publishing the manifest", final) from exc
                self.catalog.mark_committed(entry_id, supersedes)
                self.checkpoint("catalog.committed")
            except (OSError, SpoolError, sqlite3.DatabaseError) as exc:
                if not published:
                    # Roll back the intent so the row does not pin the objects; they become
                    # orphans, reclaimed by age. Best effort: recovery does the same.
                    with contextlib.suppress(sqlite3.DatabaseError):
                        self.catalog.delete_entries([entry_id])
                if isinstance(exc, OSError):
                    raise io_error(exc, "committing an entry", final) from exc
                raise
            return manifest

    def _existing_for_put(self, entry_id: str, supersedes: str | None) -> Manifest | None:
        """The already-committed entry ``entry_id`` (revived if released), or None."""
        row = self.catalog.get(entry_id)
        path = self.layout.manifest_path(entry_id)
        if (row is not None and row.state == "committed") or (row is None and path.exists()):
            try:
                manifest = self._load_manifest_file(entry_id, path)
            except FileNotFoundError:
                return None
            except ManifestError as exc:
                self.quarantine_entry(entry_id, exc.reason, exc.message)
                return None
            if not all(self.layout.object_path(r.digest).exists() for r in manifest.objects):
                return None  # an object was lost: rewrite the entry
            if row is None:
                self.catalog.index_manifest(manifest, path.stat().st_size, last_access=time.time())
            elif row.hint != "retain":
                self.catalog.set_hint(entry_id, "retain")
            if supersedes:
                self.catalog.set_hint(supersedes, "release")
            return manifest
        return None

    def _publish_object(self, name: str, payload: Payload) -> ObjectRef:
        chunks = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else payload
        tmp, digest, size = write_tmp(self.layout.tmp, chunks, checkpoint=self.checkpoint)
        final = self.layout.object_path(digest)
        try:
            self.checkpoint("object.fsynced")
            ensure_real_dirs(self.root, final.parent)
            if os.path.lexists(final):
                if self._existing_object_ok(final, digest, size):
                    os.unlink(tmp)
                    return ObjectRef(name=name, digest=digest, size=size)
                self._quarantine_files(None, QuarantineReason.OBJECT_COLLISION,
                                       "existing object did not match its name; replaced",
                                       [(final, "object")])
            os.replace(tmp, final)
            self.checkpoint("object.published")
            fsync_dir(final.parent)
            self.checkpoint("object.dir_fsynced")
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise io_error(exc, "publishing an object", final) from exc
        return ObjectRef(name=name, digest=digest, size=size)

    @staticmethod
    def _existing_object_ok(path: Path, digest: str, size: int) -> bool:
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                return False
            return hash_file(path) == (digest, size)
        except OSError:
            return False

    # -- lookup and read ----------------------------------------------------------------

    def entry_id(self, kind: str, namespace: str, key: str) -> str:
        return entry_id_for(kind, namespace, key)

    def lookup(self, kind: str, namespace: str, key: str, *, touch: bool = True) -> Manifest | None:
        """The live manifest for ``key``, or None (a miss). Never raises on corruption:
        a bad manifest is quarantined and reported as a miss."""
        entry_id = entry_id_for(kind, namespace, key)
        if not self.live([entry_id]):
            return None
        try:
            manifest = self.manifest(entry_id)
        except (NotFoundError, CorruptionError):
            return None
        if touch:
            self.touch([entry_id])
        return manifest

    def live(self, entry_ids: Iterable[str]) -> set[str]:
        """Which of ``entry_ids`` are committed and retained (catalog only; no file I/O)."""
        ids = list(entry_ids)
        return self._guarded(lambda: self.catalog.live(ids))

    def live_keys(self, kind: str, namespace: str) -> set[str]:
        """Keys of the committed, retained entries of ``(kind, namespace)`` (catalog only)."""
        return self._guarded(lambda: self.catalog.live_keys(kind, namespace))

    def next_generation(self, name: str) -> int:
        """Advance and return a counter persisted in the catalog.

        Used as a restart epoch: every caller gets a larger number than any earlier
        caller on this root; the value is at least the time in milliseconds, so it keeps
        growing across a catalog rebuild (unless the clock was set back)."""
        return self._guarded(lambda: self.catalog.next_generation(name))

    def touch(self, entry_ids: Iterable[str]) -> None:
        """Move the LRU clock of ``entry_ids`` (cheap: skipped when recent)."""
        ids = list(entry_ids)
        with contextlib.suppress(BusyError):
            self._guarded(lambda: self.catalog.touch(ids, time.time()))

    def manifest(self, entry_id: str) -> Manifest:
        """Load and validate the manifest of ``entry_id``.

        Raises NotFoundError if there is none, ManifestError (after quarantining
        the entry) if it is unreadable or invalid.
        """
        validate_entry_id(entry_id)
        try:
            return self._load_manifest_file(entry_id, self.layout.manifest_path(entry_id))
        except FileNotFoundError:
            raise NotFoundError(f"no entry {entry_id}", path=self.root,
                                fix="list entries with `spoolctl ls`") from None
        except ManifestError as exc:
            self.quarantine_entry(entry_id, exc.reason, exc.message)
            raise

    def _load_manifest_file(self, entry_id: str, path: Path) -> Manifest:
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

    def read(self, manifest: Manifest, name: str, *, into: memoryview | None = None) -> memoryview:
        """Return object ``name`` of ``manifest``, verified against its digest in the same pass.

        On a digest or size mismatch, or a missing object, the entry is quarantined
        and CorruptionError raised (a miss for the caller). If the entry was deleted
        by maintenance meanwhile, NotFoundError is raised instead (also a miss).
        """
        ref = manifest.object(name)
        path = self.layout.object_path(ref.digest)
        try:
            return read_verified(path, digest=ref.digest, size=ref.size, into=into)
        except CorruptionError as exc:
            exc.entry_id = manifest.entry_id
            self.quarantine_entry(manifest.entry_id, exc.reason, exc.message,
                                  bad_digests=[ref.digest])
            raise
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ELOOP):
                raise io_error(exc, "reading an object", path) from exc
            if not self.layout.manifest_path(manifest.entry_id).exists():
                raise NotFoundError(f"entry {manifest.entry_id} was deleted", path=self.root,
                                    fix="nothing to do: it is a cache miss") from None
            reason = QuarantineReason.PAYLOAD_MISSING
            bad = [ref.digest] if exc.errno == errno.ELOOP else []
            self.quarantine_entry(manifest.entry_id, reason, f"object {name} missing",
                                  bad_digests=bad)
            raise CorruptionError(f"object {name} of entry {manifest.entry_id} is missing",
                                  reason=reason, path=path, entry_id=manifest.entry_id,
                                  fix="the entry was quarantined; it is a cache miss") from None

    def read_all(self, manifest: Manifest) -> dict[str, memoryview]:
        """Every object of ``manifest``, verified (see ``read``)."""
        return {ref.name: self.read(manifest, ref.name) for ref in manifest.objects}

    def verify(self, entry_id: str) -> Manifest:
        """Re-read and verify the manifest and every object of ``entry_id`` now.

        Returns the manifest if healthy; raises NotFoundError or CorruptionError
        (the entry is then quarantined).
        """
        manifest = self.manifest(entry_id)
        for ref in manifest.objects:
            self.read(manifest, ref.name)
        return manifest

    # -- hints ---------------------------------------------------------------------------

    def release(self, entry_id: str) -> bool:
        """Mark ``entry_id`` released: out of reuse at once, bytes deleted by cleanup.
        Returns False if there is no such committed entry."""
        validate_entry_id(entry_id)
        return self._guarded(lambda: self.catalog.set_hint(entry_id, "release"))

    def retain(self, entry_id: str) -> bool:
        validate_entry_id(entry_id)
        return self._guarded(lambda: self.catalog.set_hint(entry_id, "retain"))

    def update_index(self, entry_id: str, changes: Mapping[str, Any]) -> bool:
        """Merge ``changes`` into the catalog copy of the entry's index (None deletes a key).

        For mutable facts of immutable entries, such as a hosted cache's new expire
        time or ``remote_pending`` (see ``clean_released``). Catalog-only, like hints:
        a catalog rebuild restores the manifest's index. False if there is no entry.
        """
        validate_entry_id(entry_id)
        try:
            canonical_json(dict(changes))
        except (TypeError, ValueError):
            raise ConfigError("index changes must be finite JSON values",
                              fix="pass strings, numbers, booleans, lists, dicts or None") from None
        return self._guarded(lambda: self.catalog.update_index(entry_id, dict(changes)))

    # -- quarantine ------------------------------------------------------------------------

    def quarantine_entry(
        self, entry_id: str, reason: QuarantineReason, detail: str,
        *, bad_digests: Iterable[str] = (),
    ) -> Path:
        """Remove ``entry_id`` from the catalog and move its manifest (and the objects
        named in ``bad_digests``) into a new quarantine item."""
        files = [(self.layout.manifest_path(entry_id), "manifest")]
        files += [(self.layout.object_path(d), "object") for d in bad_digests]
        return self._quarantine_files(entry_id, reason, detail, files)

    def _quarantine_files(self, entry_id, reason, detail, files) -> Path:
        kind = None
        if entry_id is not None and self._catalog is not None:
            with contextlib.suppress(sqlite3.DatabaseError):
                row = self.catalog.get(entry_id)
                kind = row.kind if row else None
                self.catalog.delete_entries([entry_id])
        self.checkpoint("quarantine.catalog_deleted")
        item = self.quarantine.add(reason, detail, files, entry_id=entry_id, kind=kind,
                                   checkpoint=self.checkpoint)
        log.warning("quarantined %s: %s", item.name, reason.value)
        return item

    def quarantine_items(self) -> list[QuarantineItem]:
        return self.quarantine.items()

    def restore_quarantined(self, item_id: str) -> Manifest:
        """Re-admit a quarantined entry if, and only if, it now verifies.

        Raises CorruptionError (nothing moved) if its manifest or objects still fail.
        """
        item = self.quarantine.get(item_id)
        if item.entry_id is None:
            raise ConfigError(f"quarantine item {item_id} holds no entry", path=item.path,
                              fix="inspect it with `spoolctl quarantine show`; purge when done")
        entry_id = validate_entry_id(item.entry_id)
        src = item.path / f"{entry_id}.json"
        try:
            manifest = self._load_manifest_file(entry_id, src)
        except FileNotFoundError:
            raise CorruptionError("the item has no manifest to restore",
                                  reason=QuarantineReason.MANIFEST_IO, path=src) from None
        with self._maintenance(exclusive=False, timeout=self.lock_timeout,
                  what="restoring from quarantine"):
            moves = []
            for ref in manifest.objects:
                in_item = item.path / f"{ref.digest}.obj"
                in_store = self.layout.object_path(ref.digest)
                candidate = in_item if in_item.exists() else in_store
                try:
                    read_verified(candidate, digest=ref.digest, size=ref.size)
                except (OSError, CorruptionError) as exc:
                    raise CorruptionError(f"object {ref.name} still fails: {exc}",
                                          reason=QuarantineReason.PAYLOAD_DIGEST,
                                          path=candidate) from None
                if candidate == in_item:
                    moves.append((in_item, in_store))
            for a, b in moves:
                os.replace(a, b)
                fsync_dir(b.parent)
            final = self.layout.manifest_path(entry_id)
            os.replace(src, final)
            fsync_dir(final.parent)
            self.catalog.index_manifest(manifest, final.stat().st_size, last_access=time.time())
        self.quarantine.remove(item)
        return manifest

    # -- maintenance -------------------------------------------------------------------------

    def clean_released(self, *, dry_run: bool = False) -> DeleteReport:
        """Delete every released entry and the objects no other entry references.

        Entries held for a remote delete (index ``remote_pending``) are skipped, as
        they are by eviction: their record is what lets ``clean --genai`` retry."""
        def run() -> DeleteReport:
            with self._maintenance(exclusive=True, timeout=self.lock_timeout,
                      what="cleaning released entries"):
                report = DeleteReport(dry_run=dry_run)
                if dry_run:
                    rows = self.catalog.list(hint="release", sort="age", skip_held=True)
                    report.entries = len(rows)
                    report.bytes = sum(r.size for r in rows)
                    report.entry_ids = [r.entry_id for r in rows]
                    return report
                # Id order: each batch touches few manifest fan-out dirs, so it needs few
                # directory fsyncs (10k released entries: ~256 instead of ~2,500).
                while rows := self.catalog.list(hint="release", sort="id", limit=DELETE_BATCH,
                                                skip_held=True):
                    report.add(self._delete_entries([r.entry_id for r in rows], "clean"))
                return report
        return self._guarded(run)

    def delete_released(self, entry_ids: Iterable[str]) -> DeleteReport:
        """Delete those of ``entry_ids`` that are still released (a controller's own
        released entries at ``close()``); an entry revived by a later commit is kept."""
        ids = [validate_entry_id(e) for e in entry_ids]

        def run() -> DeleteReport:
            with self._maintenance(exclusive=True, timeout=self.lock_timeout,
                      what="deleting released entries"):
                doomed = [e for e in ids
                          if (row := self.catalog.get(e)) is not None and row.hint == "release"]
                return self._delete_entries(doomed, "clean") if doomed else DeleteReport()
        return self._guarded(run)

    def enforce_capacity(
        self, *, dry_run: bool = False, budget: int | None = None, wait: bool = True
    ) -> DeleteReport:
        """If over ``max_bytes``, evict released entries first, then least recently used,
        down to 90% of the maximum. ``budget`` bounds the entries evicted in one call."""
        if self.max_bytes is None:
            return DeleteReport(dry_run=dry_run)

        def run() -> DeleteReport:
            with self._maintenance(exclusive=True,
                      timeout=self.lock_timeout if wait else 0, what="capacity maintenance"):
                return self._evict(dry_run, budget)
        return self._guarded(run)

    def _evict(self, dry_run: bool, budget: int | None) -> DeleteReport:
        assert self.max_bytes is not None
        report = DeleteReport(dry_run=dry_run)
        total = self.catalog.totals().bytes
        if total <= self.max_bytes:
            return report
        target = int(self.max_bytes * LOW_WATERMARK)
        remaining = budget if budget is not None else 1 << 62
        if dry_run:
            for entry_id, _hint in self.catalog.eviction_order(min(remaining, 1 << 20)):
                if total <= target:
                    break
                row = self.catalog.get(entry_id)
                total -= row.size if row else 0
                report.entries += 1
                report.bytes += row.size if row else 0
                report.entry_ids.append(entry_id)
            return report
        while total > target and remaining > 0:
            batch, estimate = [], 0
            for entry_id, _hint in self.catalog.eviction_order(min(remaining, DELETE_BATCH)):
                row = self.catalog.get(entry_id)
                batch.append(entry_id)
                estimate += row.size if row else 0
                if total - estimate <= target:
                    break
            if not batch:
                break
            report.add(self._delete_entries(batch, "evict"))
            remaining -= len(batch)
            total = self.catalog.totals().bytes
        return report

    def _delete_entries(self, entry_ids: list[str], step: str) -> DeleteReport:
        """Delete entries: manifests, then catalog rows, then freed objects. Caller holds
        the exclusive maintenance lock."""
        report = DeleteReport(entries=len(entry_ids), entry_ids=list(entry_ids))
        dirs: set[Path] = set()
        paths = [self.layout.manifest_path(entry_id) for entry_id in entry_ids]
        for path, size in zip(paths, unlink_many(paths), strict=True):  # concurrent (fsio)
            if size is not None:
                report.bytes += size
                dirs.add(path.parent)
            self.checkpoint(f"{step}.manifest_deleted")
        for d in dirs:
            fsync_dir(d)
        freed = self.catalog.delete_entries(entry_ids)
        self.checkpoint(f"{step}.catalog_deleted")
        paths = [self.layout.object_path(digest) for digest, _size in freed]
        for (_digest, size), gone in zip(freed, unlink_many(paths), strict=True):
            if gone is not None:
                report.objects += 1
                report.bytes += size
            self.checkpoint(f"{step}.object_deleted")
        # No fsync of the object directories: an object unlink lost in a crash leaves an
        # unreferenced object, which orphan collection reclaims (the catalog deletion above
        # is already durable). This halves the directory fsyncs of every deletion batch.
        return report

    def _resolve_pending(self) -> None:
        """Finish or roll back commits interrupted by a crash (exclusive lock held)."""
        for entry_id in self.catalog.pending():
            path = self.layout.manifest_path(entry_id)
            manifest = self._decode_manifest_file(path) if path.exists() else None
            if manifest is not None:
                self.catalog.mark_committed(entry_id, manifest.supersedes)
            else:
                self._delete_entries([entry_id], "clean")

    def clean_tmp(
        self, *, min_age: float = DEFAULT_ORPHAN_AGE, dry_run: bool = False
    ) -> DeleteReport:
        """Delete temp files whose writer is dead, or that are older than ``min_age``
        seconds and whose writer is not a live process of this host.

        A temp file of a live writer is kept unless it is older than an hour (a real
        write takes seconds; only a reused pid can be that old), so ``min_age=0`` never
        breaks a commit in flight.
        """
        report = DeleteReport(dry_run=dry_run)
        now = time.time()
        for e in os.scandir(self.layout.tmp):
            m = _TMP_RE.fullmatch(e.name)
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            writer = int(m.group(1)) if m else None
            alive = writer is None or writer == os.getpid() or _pid_alive(writer)
            age = now - st.st_mtime
            if alive and age < max(min_age, LIVE_WRITER_GRACE):
                continue
            report.files += 1
            report.bytes += st.st_size
            if not dry_run:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)
        return report

    def _remove_abandoned_tmp(self) -> None:
        self.clean_tmp(min_age=float("inf"))

    def collect_orphans(
        self, *, min_age: float = DEFAULT_ORPHAN_AGE, dry_run: bool = False
    ) -> ReconcileReport:
        """Reconcile catalog and disk under the exclusive lock, then delete objects that no
        manifest references and that are older than ``min_age`` seconds.

        Manifests missing from the catalog are indexed (or quarantined if invalid),
        catalog rows whose manifest is gone are dropped, unknown files are reported.
        """
        def run() -> ReconcileReport:
            with self._maintenance(exclusive=True, timeout=self.lock_timeout,
                      what="collecting orphans"):
                return self._reconcile(min_age, dry_run)
        return self._guarded(run)

    def _reconcile(self, min_age: float, dry_run: bool) -> ReconcileReport:
        report = ReconcileReport()
        report.orphan_objects.dry_run = dry_run
        if not dry_run:
            self._resolve_pending()
        indexed = self.catalog.all_entry_ids()
        on_disk: set[str] = set()
        for path in self._iter_manifest_files():
            entry_id = path.name[:-5]
            on_disk.add(entry_id)
            if entry_id in indexed or dry_run:
                continue
            manifest = self._decode_manifest_file(path)
            if manifest is None:
                report.quarantined += 1
            else:
                self.catalog.index_manifest(manifest, path.stat().st_size)
                report.indexed += 1
        report.unknown_files += self._unknown_in(self.layout.manifests, _MAN_RE)
        gone = sorted(indexed - on_disk)
        if gone and not dry_run:
            freed = self.catalog.delete_entries(gone)
            for digest, _size in freed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.layout.object_path(digest))
        report.dropped_rows = len(gone)
        known = self.catalog.all_digests()
        now = time.time()
        for fan in os.scandir(self.layout.objects):
            if not fan.is_dir(follow_symlinks=False):
                continue
            for e in os.scandir(fan.path):
                if not _OBJ_RE.fullmatch(e.name):
                    continue
                if e.name[:-4] in known:
                    continue
                st = e.stat(follow_symlinks=False)
                if now - st.st_mtime < min_age:
                    report.young_orphans += 1
                    continue
                report.orphan_objects.objects += 1
                report.orphan_objects.bytes += st.st_size
                if not dry_run:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.path)
        report.unknown_files += self._unknown_in(self.layout.objects, _OBJ_RE)
        return report

    def _unknown_in(self, parent: Path, pattern: re.Pattern[str]) -> list[str]:
        out = []
        for fan in os.scandir(parent):
            if not fan.is_dir(follow_symlinks=False) or len(fan.name) != 2:
                out.append(fan.path)
                continue
            for e in os.scandir(fan.path):
                if not pattern.fullmatch(e.name) or not e.name.startswith(fan.name) or \
                        not e.is_file(follow_symlinks=False):
                    out.append(e.path)
        return out

    def _scan_top_level(self) -> list[str]:
        return sorted(name for name in os.listdir(self.root) if name not in KNOWN_TOP)

    # -- information ---------------------------------------------------------------------

    def totals(self) -> Totals:
        return self._guarded(lambda: self.catalog.totals())

    def by_kind(self) -> dict[str, dict[str, int]]:
        return self._guarded(lambda: self.catalog.by_kind())

    def released(self) -> tuple[int, int]:
        """(count, bytes) of released entries waiting for cleanup."""
        return self._guarded(lambda: self.catalog.released_stats())

    def entries(self, **filters: Any) -> list[CatalogRow]:
        """Catalog rows; see ``Catalog.list`` for filters (kind, namespace, hint, sort, limit)."""
        return self._guarded(lambda: self.catalog.list(**filters))

    def row(self, entry_id: str) -> CatalogRow | None:
        validate_entry_id(entry_id)
        return self._guarded(lambda: self.catalog.get(entry_id))

    def resolve(self, text: str) -> str:
        """Resolve a full id or a unique prefix (>= 4 hex) to an entry id."""
        validate_entry_prefix(text)
        if len(text) == 64:
            return text
        matches = self._guarded(lambda: self.catalog.resolve_prefix(text))
        if not matches:
            raise NotFoundError(f"no entry matches {text}", path=self.root,
                                fix="list entries with `spoolctl ls`")
        if len(matches) > 1:
            raise InvalidIdError(f"entry prefix {text} is ambiguous",
                                 fix="type more characters of the id")
        return matches[0]

    def tmp_usage(self) -> tuple[int, int]:
        """(files, bytes) under tmp/."""
        files = size = 0
        for e in os.scandir(self.layout.tmp):
            with contextlib.suppress(FileNotFoundError):
                size += e.stat(follow_symlinks=False).st_size
                files += 1
        return files, size

    def owner(self) -> OwnerInfo | None:
        return read_owner(self.layout.state / "owner.lock", self.layout.state / "owner.json")

    def acquire_owner_lease(self, role: str) -> OwnerLease | None:
        """Take the owner lease (non-blocking); None if another live process holds it."""
        lease = OwnerLease(self.layout.state / "owner.lock", self.layout.state / "owner.json", role)
        return lease if lease.try_acquire() else None

    def set_max_bytes(self, max_bytes: int | None) -> None:
        from .root import write_marker

        self.marker = Marker(self.marker.store_id, self.marker.created, max_bytes)
        write_marker(self.layout, self.marker)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
