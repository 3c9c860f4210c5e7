"""A local controller's entries in its store: exact lookups, verified loads, base
selection and commits -- every store call within a deadline (``deadlines``).

A part of ``LocalCacheController``, sharing the controller's lock and its
LRU of loaded caches. Contracts:

* A stored cache is used only if its manifest identity, token ids, prefix digests and
  payload digests all verify, and (for an exact lookup) its tokens are the plan's prefix.
  Anything else is a miss: the store has already quarantined corrupt bytes; an entry that
  verifies but does not fit the model is quarantined here (unless read-only); I/O trouble
  or a late read is a miss and no quarantine (the entry may be fine later).
* A base is one of the namespace's retained entries of this tenant (``tokens.rank_bases``
  by the token marks of its catalog row, at most ``MAX_BASE_TRIES`` manifests read), the
  one sharing the most leading ids, cut back to those ids where the format's caches can be
  cut exactly (full attention); other caches only extend a whole entry (a checkpoint).
* A disk that does not answer in time is ``disk_down`` in the controller's statistics and
  a miss (``on_disk``).
* A commit never fails the request: serialization, sealing or store trouble is counted
  (``commit_failures``), logged without ids, and the cache serves from memory.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from spoolctl.store import (
    CorruptionError,
    Manifest,
    NotFoundError,
    QuarantineReason,
    SpoolError,
    Store,
)

from ..logsafe import reason
from .deadlines import StoreDeadlines
from .entry_format import EntryFormat, Loaded, Plan, base_ops
from .tenancy import Tenancy
from .tokens import BaseCandidate, PrefixDigests, common_prefix_tokens, rank_bases

log = logging.getLogger("spoolctl.controllers")

MAX_BASE_TRIES = 3


@dataclass(frozen=True)
class Staged:
    """An entry ready to put: serialized objects, meta, catalog row, the base it supersedes."""

    plan: Plan
    objects: dict[str, Any]
    meta: dict[str, Any]
    index: dict[str, Any]
    base_id: str | None


class _TransientReadError(Exception):
    """The store could not read an entry right now (I/O, busy): not the entry's fault."""


class EntryIO:
    """The store side of one controller's entries (see the module docstring). ``count``:
    the controller's statistics counter (``disk_hits``, ``load_failures``, ``disk_down``,
    ``commit_failures``); ``memory``: its LRU of loaded caches (guarded by ``lock``)."""

    def __init__(self, *, store: Store, deadlines: StoreDeadlines, tenancy: Tenancy,
                 entry_format: EntryFormat, kind: str, identity: Any, read_only: bool,
                 count: Callable[..., None], lock: threading.Condition,
                 memory: OrderedDict[str, Loaded]):
        self._store, self._deadlines, self._tenancy = store, deadlines, tenancy
        self._format, self._kind, self._read_only = entry_format, kind, read_only
        self._identity = identity
        self._count, self._lock, self._memory = count, lock, memory
        self._warned: set[str] = set()  # warnings said once per controller (then debug)

    def load_exact(self, plan: Plan, *, touch: bool) -> Loaded | None:
        """The entry of ``plan`` (``touch``: move its LRU clock), verified and loaded, or
        None: a miss, whatever the store or the entry did."""
        try:
            done, manifest = self.on_disk(lambda: self._store.lookup(
                self._kind, plan.namespace, plan.key, touch=touch and not self._read_only,
                tenant=self._tenancy.tenant), self._deadlines.lookup_deadline_s)
        except SpoolError as exc:
            log.warning("cache lookup failed, treating as a miss: %s", reason(exc))
            return None
        if not done or manifest is None:
            return None
        loaded = self.load_manifest(manifest, plan=plan,
                                    quarantine=not plan.params.read_only)
        if loaded is not None:
            self._count(disk_hits=1)
        return loaded

    def load_manifest(self, manifest: Manifest, *, plan: Plan | None,
                      quarantine: bool = True, base_of: Plan | None = None) -> Loaded | None:
        """Verify and load an entry; None (after quarantining bad entries) on any defect.
        ``plan``: the plan the entry must hold exactly (None: a base, any prefix, of the
        model state of ``base_of``)."""
        try:
            meta: Any = manifest.meta
            objects: dict[str, Any] | None = None
            if self._tenancy.active:  # the token meta is sealed: read (and decrypt) first
                try:
                    meta, objects = self._tenancy.open_meta(manifest,
                                                            self.read_objects(manifest))
                except (CorruptionError, NotFoundError):
                    raise
                except SpoolError as exc:
                    raise _TransientReadError(exc) from exc
            prefix = self._format.check(meta, plan,
                                        identity=base_of.identity if base_of else None)
            if plan is not None and prefix != plan.prefix:
                raise ValueError("cached token ids differ from the prompt's")
            try:
                if objects is None:
                    objects = self.read_objects(manifest)
            except (CorruptionError, NotFoundError):
                raise
            except SpoolError as exc:
                raise _TransientReadError(exc) from exc
            # Any error from here on, SpoolError included, is a defect of the entry itself
            # (its bytes verified but do not fit this model): quarantine it, so the next
            # prepare rebuilds it instead of missing on it forever.
            cache = self._format.load(objects, meta, prefix, plan)
            return Loaded(cache, prefix)
        except (CorruptionError, NotFoundError) as exc:
            # The store has already quarantined a corrupt entry; a deleted one is a miss.
            log.warning("cache entry unusable, treated as a miss: %s", reason(exc))
            log.debug("unusable entry: %s (%s)", manifest.entry_id, exc)
        except _TransientReadError as exc:  # I/O trouble: a miss, the entry may be fine later
            log.warning("cache entry unreadable, treated as a miss: %s",
                        reason(exc.__cause__ or exc))
        except Exception as exc:  # any mismatch inside the payload or its description
            log.warning("cache entry rejected, treated as a miss: %s", reason(exc))
            log.debug("rejected entry: %s", manifest.entry_id)
            if quarantine and not self._read_only:
                with contextlib.suppress(SpoolError):
                    self._store.quarantine_entry(
                        manifest.entry_id, QuarantineReason.MANIFEST_VALIDATION,
                        f"{self._format.label} cache rejected: {str(exc)[:300]}")
        self._count(load_failures=1)
        with self._lock:
            self._memory.pop(manifest.entry_id, None)
        return None

    def relatives(self, plan: Plan) -> list[tuple[str, str, Any]]:
        """``(entry id, key, catalog index)`` of the retained entries of the plan's
        namespace other than its own (the candidates for a base); [] on store trouble."""
        try:
            done, rows = self.on_disk(lambda: self._store.entries(
                kind=self._kind, namespace=plan.namespace, hint="retain"),
                self._deadlines.lookup_deadline_s)
        except SpoolError as exc:
            log.warning("base selection skipped: %s", reason(exc))
            return []
        if not done:
            return []
        return [(r.entry_id, r.key, r.index) for r in rows
                if r.entry_id != plan.entry_id and self._tenancy.own(r.index)]

    def from_base(self, plan: Plan, rows: list[tuple[str, str, Any]]
                  ) -> tuple[Any, int, str, str, bool] | None:
        """Best retained base: of the best-ranked rows (``tokens.rank_bases``, at most
        ``MAX_BASE_TRIES`` manifests read), the one sharing the most leading ids with the
        plan; load it, cut it to those ids where the format's caches can be cut. Returns
        ``(cache, kept tokens, base id, "memory" | "disk", whether the plan extends the
        whole base)``, or None if no usable base (any failure falls back to a cold
        prefill)."""
        candidates = rank_bases(rows, group=plan.group, elements=plan.elements,
                                exclude=plan.entry_id, lead_segments=plan.lead_segments,
                                prefix=PrefixDigests(plan.prefix.tokens,
                                                     self._tenancy.mark_key()),
                                whole_only=not getattr(self._format, "trimmable", True))
        # Snapshots serve many prompts: a prompt that extends one never supersedes it.
        snapshots = {entry_id for entry_id, _, index in rows
                     if hasattr(index, "get") and index.get("snapshot") is True}
        sized: list[tuple[int, int, BaseCandidate, Loaded | Manifest]] = []
        for rank, cand in enumerate(candidates[:MAX_BASE_TRIES]):
            found = self._shared(cand, plan)
            if found is not None:
                sized.append((found[0], rank, cand, found[1]))
        # most shared ids first; the rank breaks ties
        for keep, _, cand, held in sorted(sized, key=lambda s: (-s[0], s[1])):
            if isinstance(held, Loaded):
                cache, base_len, where = base_ops(self._format).clone(held.cache), \
                    len(held.prefix), "memory"
            else:
                loaded = self.load_manifest(held, plan=None, base_of=plan)
                if loaded is None:
                    continue
                cache, base_len, where = loaded.cache, len(loaded.prefix), "disk"
            keep = min(keep, base_len)
            try:
                if keep < base_len:
                    cache = base_ops(self._format).trim(cache, keep)
            except Exception as exc:
                log.warning("could not trim a base: %s", reason(exc))
                continue
            return cache, keep, cand.entry_id, where, \
                keep == base_len and cand.entry_id not in snapshots
        return None

    def _shared(self, cand: BaseCandidate, plan: Plan) -> tuple[int, Loaded | Manifest] | None:
        """The ids ``cand`` shares with the plan and what holds it (its loaded cache, else
        its manifest, only the meta read); None if it cannot serve (gone, unreadable,
        nothing shared, or its state is past the shared ids and cannot be cut back)."""
        with self._lock:
            in_memory = self._memory.get(cand.entry_id)
        if in_memory is not None:
            keep = common_prefix_tokens(in_memory.prefix, plan.prefix)
            if keep == 0 or not self.serves(keep, len(in_memory.prefix), len(plan.prefix)):
                return None
            return keep, in_memory
        try:
            done, manifest = self.on_disk(partial(
                self._tenancy.base_manifest, plan.namespace, cand.key, cand.entry_id),
                self._deadlines.lookup_deadline_s)
            if not done or manifest is None:
                return None
            meta = self._tenancy.open_meta(manifest)[0]  # sealed: the token meta
        except SpoolError:
            return None
        try:
            theirs = self._format.check(meta, None, identity=plan.identity)
        except ValueError:
            # bad meta: load_manifest rejects (and quarantines) it
            self.load_manifest(manifest, plan=None, base_of=plan)
            return None
        keep = common_prefix_tokens(theirs, plan.prefix)
        if keep == 0 or not self.serves(keep, len(theirs), len(plan.prefix)):
            return None  # not worth reading: its state is past the shared prefix
        return keep, manifest

    def _once(self, what: str, message: str, *args: object) -> None:
        """``message`` as a warning the first time ``what`` happens, then at debug level:
        a store that refuses every commit must not flood the log with one line a prepare."""
        with self._lock:
            first = what not in self._warned
            self._warned.add(what)
        log.log(logging.WARNING if first else logging.DEBUG, message, *args)

    def can_cut(self, keep: int, base_len: int) -> bool:
        """Whether a base of ``base_len`` tokens can serve a plan sharing ``keep`` of them:
        always by extension (``keep == base_len``); by cutting back only where the format's
        caches can be cut exactly (full attention; not recurrent or window-full states)."""
        return keep == base_len or getattr(self._format, "trimmable", True)

    def serves(self, keep: int, base_len: int, total: int) -> bool:
        """``can_cut``, and extending ``keep`` tokens to ``total`` is not estimated to cost
        more than recomputing all of them (the format's ``recompute_cheaper``)."""
        rule = getattr(self._format, "recompute_cheaper", None)
        return self.can_cut(keep, base_len) and not (callable(rule) and rule(keep, total - keep))

    def on_disk(self, fn: Any, deadline_s: float) -> tuple[bool, Any]:
        """``fn()`` (a store call) within ``deadline_s``: ``(True, result)``, or
        ``(False, None)`` if the disk did not answer in time or is known not to (counted
        as ``disk_down``). The store's errors are raised as ``fn`` raised them."""
        done, result = self._deadlines.call(fn, deadline_s)
        if not done:
            self._count(disk_down=1)
        return done, result

    def read_objects(self, manifest: Manifest) -> dict[str, Any]:
        """Every object of ``manifest``, verified (``Store.read``), each read within the
        read deadline; a late one raises ``_TransientReadError`` (a miss, no quarantine)."""
        out = {}
        for ref in manifest.objects:
            done, data = self.on_disk(partial(self._store.read, manifest, ref.name),
                                      self._deadlines.read_deadline_s)
            if not done:
                raise _TransientReadError("the store's disk did not answer in time")
            out[ref.name] = data
        return out

    def commit(self, plan: Plan, cache: Any, base_id: str | None, *,
               snapshot: bool = False, checkpoint: bool = False) -> bool:
        """Store ``cache`` as ``plan``'s entry (superseding ``base_id``; ``snapshot``: an
        instructions snapshot or, ``checkpoint``, a mid-prompt one; the catalog row gets
        the ``marks`` base selection ranks by): whether it was committed. Never raises for
        store trouble (a full disk, a busy store, a late disk): the cache still serves from
        memory."""
        staged = self.stage(plan, cache, base_id, snapshot=snapshot, checkpoint=checkpoint)
        return staged is not None and self.put(staged)

    def stage(self, plan: Plan, cache: Any, base_id: str | None, *,
              snapshot: bool = False, checkpoint: bool = False) -> Staged | None:
        """What ``commit`` puts: the serialized cache, its meta and catalog row (None, counted
        and said once, when it cannot be serialized)."""
        if self._tenancy.lost:  # said once at open; every commit would fail the same way
            return None
        try:
            objects, layout = self._format.serialize(cache, plan)
        except Exception as exc:  # the cache still serves this process from memory
            self._once("serialize", "cache could not be serialized, not persisted: %s",
                       reason(exc))
            self._count(commit_failures=1)
            return None
        own_meta, own_index = self._format.describe(plan)
        meta = {"format": self._format.name, "identity": plan.identity or self._identity,
                "layout": layout,
                "model": plan.params.model, "includes": plan.params.includes().to_json(),
                **own_meta, **plan.prefix.to_meta()}
        index = {"group": plan.group, "elements": list(plan.elements),
                 "tokens": len(plan.prefix), **own_index,
                 "marks": PrefixDigests(plan.prefix.tokens, self._tenancy.mark_key()).marks(),
                 **({"snapshot": True} if snapshot else {}),
                 **({"checkpoint": True} if checkpoint else {})}
        return Staged(plan, objects, meta, index, base_id)

    def put(self, staged: Staged) -> bool:
        """Seal and put a staged entry: whether it was committed (store trouble is counted
        and said once, never raised)."""
        plan = staged.plan
        try:
            meta, objects = self._tenancy.seal_meta(staged.meta, staged.objects)
            done, _ = self.on_disk(lambda: self._store.put(
                kind=self._kind, namespace=plan.namespace, key=plan.key, objects=objects,
                meta=meta, index=staged.index, supersedes=staged.base_id,
                tenant=self._tenancy.tenant), self._deadlines.read_deadline_s)
        except SpoolError as exc:
            # A full disk or a busy store must not fail the request: serve from memory.
            self._once("persist", "cache not persisted (%s); serving it from memory (said "
                       "once per controller; see stats()['commit_failures'])", reason(exc))
            self._count(commit_failures=1)
            return False
        return done  # not done: it completes in the background once the disk answers, or never
