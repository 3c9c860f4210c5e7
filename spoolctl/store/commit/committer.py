"""Committing entries, manifest-last: one (``Store.put``) or many together (group commit),
with one round of flushes per step, each step durable before the next (docs/format.md):

1. **stage**: objects written to temp files created ahead and hashed, bounded by their
   entry's size budget, flushes started at once; then each manifest written likewise.
2. **intent**: one catalog transaction records a pending row per entry (pinning its
   objects against a concurrent clean); then every flush is waited for.
3. **objects**: staged objects renamed to ``objects/<aa>/<digest>.obj`` (an identical one
   already there is reused, a damaged one quarantined and replaced); directories fsynced.
4. **manifests**: manifests renamed into ``manifests/`` -- only now is an entry visible --
   and their directories fsynced.
5. **committed**: one catalog transaction marks the rows committed (superseded entries
   released).

A crash leaves each entry complete or invisible; recovery rolls back pending rows without a
manifest. Per entry, all or nothing: an entry whose arguments, size or objects fail gets an
error outcome and the batch goes on; a failure of a shared step raises. The caller holds the
maintenance lock shared. Checkpoints (``faults.COMMIT_CHECKPOINTS``) are passed once per
object, manifest or directory, in this order (docs/decisions/1400-group-commit.md).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import (
    CapacityError,
    ConfigError,
    ManifestError,
    NotFoundError,
    QuarantineReason,
    SpoolError,
)
from ..capacity import low_watermark
from ..disk.fsio import (
    FLUSH_WORKERS,
    Flushing,
    SizeLimitExceeded,
    TmpFile,
    flush_submit,
    fsync_dir,
    io_error,
    read_manifest,
    unlink_quietly,
)
from ..disk.publish import Publisher
from ..disk.reserve import headroom_ok
from ..disk.space import inodes_short
from ..format.manifest import Manifest, ObjectRef, authenticate, encode
from .batch import Payload, Pending, PutOutcome, PutRequest
from .flushes import (
    MAX_FLUSHING,
    TmpAhead,
    bound,
    discard_flushing,
    existing_object_ok,
    flushed,
    object_present,
    store_full,
)
from .inputs import known_size

__all__ = ["MAX_FLUSHING", "Committer", "Payload", "Pending", "PutOutcome", "PutRequest",
           "object_present", "store_full"]

if TYPE_CHECKING:
    from ..context import PartContext

class Committer:
    """Commits entries into one store through ``publisher`` (see the module docstring)."""

    def __init__(self, ctx: PartContext, publisher: Publisher):
        self._ctx = ctx
        self._publisher = publisher

    def budget(self) -> int | None:
        """The most bytes one entry may hold: 90% of the max size (None: unbounded)."""
        max_bytes = self._ctx.limits.max_bytes
        return None if max_bytes is None else low_watermark(max_bytes)

    def check_fits(self, size: int) -> None:
        """CapacityError if an entry of ``size`` bytes exceeds the store's low watermark."""
        budget = self.budget()
        if budget is not None and size > budget:
            raise self._too_large(f"{size} bytes")

    def _too_large(self, size: str) -> CapacityError:
        return CapacityError(
            f"entry of {size} does not fit the store (max {self._ctx.limits.max_bytes}; one entry "
            "may take at most 90% of it)", path=self._ctx.root,
            fix="raise the store's max size (`spoolctl init --max-size`)")

    # -- the batch ------------------------------------------------------------------------

    def commit(self, batch: list[Pending], *, given: dict[str, Path] | None = None,
               revive: bool = True) -> None:
        """Commit ``batch`` (arguments already validated), setting each entry's outcome.

        ``given``: objects already written and flushed in ``tmp/`` and verified (digest ->
        path), which prebuilt entries rely on; they are consumed (moved into the store or
        deleted), also on error. ``revive``: an entry already committed is revived if
        released (``put``); without it, it is only reported present (import). Raises on a
        failure of a shared step (see the module docstring). The batch's creates and renames
        share one descriptor per directory (``Publisher.batch``)."""
        with self._publisher.batch():
            self._commit(batch, given=given, revive=revive)

    def _commit(self, batch: list[Pending], *, given: dict[str, Path] | None,
                revive: bool) -> None:
        given = {} if given is None else given
        first: dict[str, Pending] = {}
        try:
            live = self._not_present(batch, first, revive)
            if live:
                if not headroom_ok(self._ctx.layout.tmp):
                    # Leave the filesystem's last megabyte to maintenance (reserve.py): a
                    # commit must never take the room that lets `spoolctl clean` shed load.
                    raise store_full(self._ctx.layout.tmp)
                if (short := inodes_short(self._ctx.layout.tmp)) is not None:
                    raise store_full(self._ctx.layout.tmp, short)  # and its last inodes
                recorded = self._stage(live, given, revive=revive)
                try:
                    todo = self._place_objects([p for p in live if p.outcome is None], given)
                except BaseException:
                    self._forget_intents(recorded)  # nothing of the batch is visible
                    raise
                self._forget_intents([p for p in recorded if p.outcome is not None])
                if todo:
                    self._commit_manifests(todo)
        finally:
            for p in batch:
                self._discard(p)
            for path in given.values():
                unlink_quietly(path)
            given.clear()
        for p in batch:  # a repeated id names the same entry: it gets the first's outcome
            head = first.get(p.entry_id)
            if p.outcome is None and head is not None and head.outcome is not None:
                o = head.outcome
                p.outcome = PutOutcome(p.entry_id, "present" if o.ok else o.status,
                                       o.manifest, o.error)

    def _not_present(self, batch: list[Pending], first: dict[str, Pending],
                     revive: bool) -> list[Pending]:
        """Entries still to write: the first of each id, unless it is committed already."""
        live = []
        for p in batch:
            if p.outcome is not None or p.entry_id in first:
                continue
            first[p.entry_id] = p
            supersedes = p.request.supersedes if p.request else None
            existing = self.existing(p.entry_id, supersedes, revive=revive)
            if existing is not None:
                p.outcome = PutOutcome(p.entry_id, "present", existing)
            else:
                live.append(p)
        return live

    def existing(self, entry_id: str, supersedes: str | None, *,
                 revive: bool = True) -> Manifest | None:
        """The already-committed entry ``entry_id`` (revived if released and ``revive``),
        or None."""
        ctx = self._ctx
        catalog = ctx.catalog()
        row = catalog.get(entry_id)
        path = ctx.layout.manifest_path(entry_id)
        if (row is not None and row.state == "committed") or (row is None and path.exists()):
            try:
                manifest = read_manifest(path, entry_id)
                if ctx.tag_key is not None:  # an untagged or forged entry is rewritten
                    authenticate(ctx.tag_key, manifest, path)
            except FileNotFoundError:
                return None
            except ManifestError as exc:
                ctx.quarantine.entry(entry_id, exc.reason, exc.message)
                return None
            if not all(ctx.layout.object_path(r.digest).exists() for r in manifest.objects):
                return None  # an object was lost: rewrite the entry
            if ctx.key_available is not None and not ctx.key_available(manifest):
                # Sealed under a key that is gone (a revoked or retired tenant writing the
                # same entry again): rewrite it under the current key, never revive it.
                return None
            if row is None:
                catalog.index_manifest(manifest, path.stat().st_size, last_access=ctx.clock())
            elif row.hint != "retain" and revive:
                catalog.set_hint(entry_id, "retain", ctx.clock())
            if supersedes:
                catalog.set_hint(supersedes, "release", ctx.clock())
            return manifest
        return None

    # -- step 1: stage ----------------------------------------------------------------------

    def _stage(self, live: list[Pending], given: dict[str, Path], *,
               revive: bool = True) -> list[Pending]:
        """Steps 1-2: stage every entry, record the intents, wait for the flushes. Returns
        the entries whose intent was recorded (some may have failed since)."""
        flushing: list[Flushing] = []
        # Every file the batch writes, created ahead: one per object, one
        # per manifest.
        ahead = TmpAhead(self._publisher, sum(
            (len(p.request.objects) if p.request is not None else 0) + 1 for p in live))
        try:
            for p in live:
                self._stage_entry(p, flushing, ahead, given)
        finally:
            ahead.close()  # what a refused entry did not use
        recorded = [p for p in live if p.outcome is None]
        if recorded:
            try:
                # Without ``revive`` (an import), an entry another writer recorded since
                # ``_not_present`` looked is theirs: reported present, not committed twice.
                taken = self._ctx.catalog().record_intents(
                    [(m, len(data)) for m, data in (p.built() for p in recorded)],
                    self._ctx.clock(),
                    claim=not revive,
                    hints={p.entry_id: p.hint for p in recorded if p.hint != "retain"})
                self._publisher.mark("catalog", "intent")
            except OSError as exc:  # a fault a test injected at the checkpoint (faults.install)
                self._forget_intents(recorded)
                raise io_error(exc, "committing entries", self._ctx.layout.manifests) from exc
            for p in recorded:
                if p.entry_id in taken:
                    p.outcome = PutOutcome(p.entry_id, "present", p.manifest)
                    self._discard(p)
            recorded = [p for p in recorded if p.entry_id not in taken]
        for p in live:  # every flush of the batch is in flight: wait for them, in order
            if p.outcome is not None:
                continue
            try:
                for _name, f in p.staged:
                    flushed(f, "writing an object")
                    self._publisher.mark("object", "fsynced")
                assert p.manifest_tmp is not None
                flushed(p.manifest_tmp, "writing a manifest")
                self._publisher.mark("manifest", "fsynced")
            except SpoolError as exc:
                p.fail(exc)
                self._discard(p)
            except OSError as exc:  # a fault a test injected at a checkpoint (faults.install)
                p.fail(io_error(exc, "writing an entry", self._ctx.layout.tmp))
                self._discard(p)
        return recorded

    def _stage_entry(self, p: Pending, flushing: list[Flushing], ahead: TmpAhead,
                     given: dict[str, Path]) -> None:
        """Step 1 for one entry: its objects (a new entry) and its manifest written, their
        flushes started; on failure the entry is refused and what it staged removed."""
        try:
            if p.request is not None:
                self._stage_objects(p, flushing, ahead)
                p.manifest = Manifest.new(
                    kind=p.request.kind, namespace=p.request.namespace, key=p.request.key,
                    created=self._ctx.clock(),
                    objects=tuple(ObjectRef(name, f.digest, f.size) for name, f in p.staged),
                    meta=p.request.meta, index=p.request.index,
                    supersedes=p.request.supersedes)
                p.data = encode(p.manifest, self._ctx.tag_key)
            else:
                assert p.manifest is not None, "an entry built elsewhere has its manifest"
                missing = [r for r in p.manifest.objects
                           if r.digest not in given and not object_present(self._ctx.layout, r)]
                if missing:
                    p.fail(NotFoundError(f"object {missing[0].name} of entry "
                                         f"{p.entry_id} is no longer in the store"),
                           "vanished")
                    return
            p.manifest_tmp = self._publisher.stage_flushing([p.built()[1]], what="manifest",
                                                            into=ahead.next())
            bound(flushing, p.manifest_tmp)
        except SpoolError as exc:
            p.fail(exc)
            self._discard(p)
        except ValueError as exc:  # a manifest that does not validate (caller checked)
            p.fail(ConfigError(f"entry {p.entry_id[:16]}: {exc}",
                               fix="check the entry's meta, index and objects"))
            self._discard(p)

    def _forget_intents(self, failed: list[Pending]) -> None:
        """Remove the pending rows of entries refused after their intent was recorded, so
        they do not pin objects (left as orphans, reclaimed by age). Best effort: recovery
        rolls back any pending row whose manifest never appeared."""
        if failed:
            with contextlib.suppress(sqlite3.DatabaseError):
                self._ctx.catalog().delete_entries([p.entry_id for p in failed])

    def _stage_objects(self, p: Pending, flushing: list[Flushing], ahead: TmpAhead) -> None:
        assert p.request is not None
        objects = p.request.objects
        self.check_fits(sum(known_size(v) or 0 for v in objects.values()))
        budget = self.budget()
        for name, payload in objects.items():
            left = None if budget is None else budget - sum(f.size for _, f in p.staged)
            f = self._stage_one(name, payload, left, ahead.next())
            p.staged.append((name, f))
            bound(flushing, f)

    def _stage_one(self, name: str, payload: Payload, left: int | None,
                   into: TmpFile | None = None) -> Flushing:
        chunks: Iterable[bytes | bytearray | memoryview] = \
            [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else payload
        try:
            return self._publisher.stage_flushing(chunks, what="object", limit=left,
                                                  into=into)
        except SizeLimitExceeded:
            raise self._too_large(f"more than {self.budget()} bytes (object {name} was "
                                  "still streaming)") from None
        except TypeError as exc:
            raise ConfigError(f"object {name}: a streamed chunk is not bytes-like ({exc})",
                              fix="yield bytes, bytearray or memoryview chunks") from None

    # -- step 3: objects --------------------------------------------------------------------

    def _place_objects(self, todo: list[Pending], given: dict[str, Path]) -> list[Pending]:
        """Rename every staged object into place; fsync their directories once each. An
        entry whose object cannot be placed is refused; the others go on."""
        layout = self._ctx.layout
        done: set[str] = set()
        dirs: set[Path] = set()
        for p in todo:
            final = layout.objects
            try:
                if p.staged:
                    # Written through descriptors opened ahead, renamed by
                    # path: a tmp/ swapped for a link since then is named as such.
                    final = layout.tmp
                    self._publisher.check_dirs(layout.tmp)
                for _name, f in p.staged:
                    final = layout.object_path(f.digest)
                    self._place(f.path, final, f.digest, f.size, done)
                    dirs.add(final.parent)
                assert p.manifest is not None
                for ref in p.manifest.objects:
                    final = layout.object_path(ref.digest)
                    if ref.digest in given:  # verified by the import: replaces what is there
                        self._publisher.check_dirs(final.parent)
                        self._publisher.place(given.pop(ref.digest), final, what="object")
                        done.add(ref.digest)
                    # Reused objects too: a manifest may only name objects whose names are
                    # durable (another commit may have renamed one in and not synced yet).
                    dirs.add(final.parent)
            except OSError as exc:
                p.fail(io_error(exc, "publishing an object", final))
                self._discard(p)
        todo = [p for p in todo if p.outcome is None]
        if todo:
            self._sync(dirs, "object", "publishing objects")
        return todo

    def _place(self, src: Path, final: Path, digest: str, size: int, done: set[str]) -> None:
        if digest in done:  # an earlier entry of this batch placed the same bytes
            unlink_quietly(src)
            return
        self._publisher.check_dirs(final.parent)
        checked = True
        if os.path.lexists(final):
            if existing_object_ok(final, digest, size):
                unlink_quietly(src)  # content-addressed: already stored
                done.add(digest)
                return
            self._ctx.quarantine.files(None, QuarantineReason.OBJECT_COLLISION,
                                       "existing object did not match its name; replaced",
                                       [(final, "object")])
            checked = False  # the quarantine moved files meanwhile: check again
        self._publisher.place(src, final, what="object", checked=checked)
        done.add(digest)

    def _sync(self, dirs: Iterable[Path], what: str, doing: str) -> None:
        """fsync ``dirs`` concurrently (the filesystem merges them); StoreIOError if any
        fails. A single directory (every ``put``) is fsynced on this thread: handing it to
        the pool and waiting would only add two thread switches to the commit's critical
        path. Many (a group commit touches ~30 fan-outs per step) go to
        the pool as at most ``FLUSH_WORKERS`` lanes, each fsyncing its share in turn:
        as many fsyncs in flight as the pool runs anyway, one hand-off per lane instead
        of one per directory."""
        ordered = sorted(set(dirs))
        if len(ordered) == 1:
            try:
                fsync_dir(ordered[0])
                self._publisher.mark(what, "dir_fsynced")  # may raise an injected fault
            except OSError as exc:
                raise io_error(exc, doing, ordered[0]) from exc
            return
        lanes = min(len(ordered), FLUSH_WORKERS)
        pending = [flush_submit(_fsync_dirs, ordered[i::lanes]) for i in range(lanes)]
        errors: dict[Path, OSError] = {}
        for fut in pending:
            errors.update(fut.result())
        for d in ordered:  # checkpoints and the first error in the same order as before
            try:
                if d in errors:
                    raise errors[d]
                self._publisher.mark(what, "dir_fsynced")  # may raise an injected fault
            except OSError as exc:
                raise io_error(exc, doing, d) from exc

    # -- steps 4-5: manifests, committed -----------------------------------------

    def _commit_manifests(self, todo: list[Pending]) -> None:
        ctx = self._ctx
        catalog = ctx.catalog()
        recorded = [p.entry_id for p in todo]  # their intents are in the catalog (step 2)
        published: set[str] = set()
        final = ctx.layout.tmp
        try:
            self._publisher.check_dirs(final)  # the manifests are renamed from tmp/
            for p in todo:
                final = ctx.layout.manifest_path(p.entry_id)
                placed: list[Path] = []
                try:
                    self._publisher.place(p.staged_manifest().path, final, what="manifest",
                                          placed=placed)
                finally:
                    if placed:
                        published.add(p.entry_id)
            self._sync((ctx.layout.manifest_path(p.entry_id).parent for p in todo),
                       "manifest", "publishing manifests")
            catalog.mark_committed_many([(p.entry_id, p.built()[0].supersedes) for p in todo])
            self._publisher.mark("catalog", "committed")
        except (OSError, SpoolError, sqlite3.DatabaseError) as exc:
            # Roll back the intents of entries that never became visible, so their rows do
            # not pin the objects (orphans now, reclaimed by age). Best effort: recovery does
            # the same. A renamed manifest's pending row is resolved by recovery.
            with contextlib.suppress(sqlite3.DatabaseError):
                catalog.delete_entries([e for e in recorded if e not in published])
            if isinstance(exc, OSError):
                raise io_error(exc, "committing entries", final) from exc
            raise
        for p in todo:
            p.outcome = PutOutcome(p.entry_id, "committed", p.manifest)

    # -- helpers ---------------------------------------------------------------------------

    def _discard(self, p: Pending) -> None:
        """Remove what ``p`` staged and did not publish (renamed files are gone already)."""
        for _name, f in p.staged:
            discard_flushing(f)
        if p.manifest_tmp is not None:
            discard_flushing(p.manifest_tmp)

    def publish_object(self, name: str, payload: Payload) -> ObjectRef:
        """Stage ``payload`` and make it ``objects/<aa>/<digest>.obj``, its directory synced
        (no entry names it: an orphan until one does)."""
        f = self._stage_one(name, payload, self.budget())
        try:
            flushed(f, "writing an object")
            self._publisher.mark("object", "fsynced")
            final = self._ctx.layout.object_path(f.digest)
            try:
                self._place(f.path, final, f.digest, f.size, set())
            except OSError as exc:
                raise io_error(exc, "publishing an object", final) from exc
            self._sync([final.parent], "object", "publishing an object")
            return ObjectRef(name=name, digest=f.digest, size=f.size)
        finally:
            discard_flushing(f)


def _fsync_dirs(dirs: list[Path]) -> dict[Path, OSError]:
    """fsync each of ``dirs`` in turn (one lane of a parallel directory sync); the failures, by
    directory (every directory is tried: the caller reports the first, in order)."""
    errors: dict[Path, OSError] = {}
    for d in dirs:
        try:
            fsync_dir(d)
        except OSError as exc:
            errors[d] = exc
    return errors
