"""Building an entry: the slow path of ``LocalCacheController.prepare``.

A part the controller is composed of: ``EntryBuilder`` gets a ``BuildContext`` (the
controller's store, format, locks and in-memory books), never the controller. Under the key
stripe's lock it loads an exact hit, else extends the best base, else prefills cold (through
an instructions snapshot and mid-prompt checkpoints for caches that cannot be cut back),
commits, and supersedes a base only that entry strictly extends.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from spoolctl.store import ConfigError, SpoolError, Store, hold

from ..contract import CacheHandle, CachePrepareParams
from ..logsafe import reason
from .background_puts import BackgroundPuts
from .deadlines import StoreDeadlines
from .entry_format import EntryFormat, Loaded, Plan, base_ops
from .entry_io import EntryIO, Staged
from .handle_book import HandleBook
from .plan_rules import checkpoint_plan, checkpoint_positions, same_params, snapshot_plan
from .tenancy import Tenancy
from .usage import ControllerStats, PrepareWork

log = logging.getLogger("spoolctl.controllers")

LOCK_STRIPES = 256  # lock files per store: bounded, and two keys rarely share one


@dataclass
class BuildContext:
    """What ``EntryBuilder`` uses of its controller: shared objects, read under ``lock``."""

    format: EntryFormat
    entries: EntryIO
    store: Store
    deadlines: StoreDeadlines
    tenancy: Tenancy
    kind: str
    lock: threading.Condition
    book: HandleBook
    stats: ControllerStats
    memory: OrderedDict[str, Loaded]
    released: set[str]
    superseded: dict[str, str]
    count: Callable[..., None]
    lock_timeout: Callable[[], float]
    memory_entries: Callable[[], int]


class EntryBuilder:
    """The prepare path past a memory hit, and the commit of an imported cache."""

    def __init__(self, ctx: BuildContext):
        self._ctx = ctx
        self._puts = BackgroundPuts(ctx.entries.put)

    def close(self) -> None:
        """Write the checkpoints still waiting, then stop their writer."""
        self._puts.close()

    def handle(self, plan: Plan, *, source: str, written: int = 0, reused: int = 0,
                computed: int = 0, supersedes: str | None = None) -> CacheHandle:
        return CacheHandle(ref=plan.entry_id, includes=plan.params.includes(),
                           supersedes=supersedes, cached_tokens=len(plan.prefix),
                           written_tokens=written, reused_tokens=reused, source=source,
                           computed_tokens=computed)

    @contextlib.contextmanager
    def key_lock(self, entry_id: str) -> Iterator[None]:
        # Stripes keep the number of lock files bounded (deleting a lock file someone may
        # be waiting on is unsafe, so they are never deleted).
        stripe = int(entry_id[:2], 16) % LOCK_STRIPES
        path = self._ctx.store.layout.state / f"prepare-{stripe:02x}.lock"
        with hold(path, exclusive=True, timeout=self._ctx.lock_timeout(), what="preparing a cache"):
            yield

    def prepare_slow(self, plan: Plan) -> tuple[CacheHandle, PrepareWork | None]:
        if plan.params.read_only:
            loaded = self._ctx.entries.load_exact(plan, touch=False)
            if loaded is None:
                return CacheHandle.empty(), None
            self.remember(plan, loaded)
            return self.handle(plan, source="disk"), PrepareWork(disk=len(plan.prefix))
        # A hit needs no lock; and a disk that did not answer is not waited on for one
        # (the lock file is on it): the prepare goes on without the store.
        loaded = self._ctx.entries.load_exact(plan, touch=True)
        if loaded is not None:
            self.remember(plan, loaded)
            return self.handle(plan, source="disk"), PrepareWork(disk=len(plan.prefix))
        try:
            if self._ctx.deadlines.down:
                return self.prepare_locked(plan)  # every store call is skipped at once
            with self.key_lock(plan.entry_id):
                return self.prepare_locked(plan)
        except SpoolError as exc:
            if isinstance(exc, ConfigError):
                raise
            log.warning("prepare fell back to a cold run: %s", reason(exc))
            return CacheHandle.empty(), None

    def prepare_locked(self, plan: Plan) -> tuple[CacheHandle, PrepareWork | None]:
        total = len(plan.prefix)
        loaded = self._ctx.entries.load_exact(plan, touch=True)
        if loaded is not None:
            self.remember(plan, loaded)
            return self.handle(plan, source="disk"), PrepareWork(disk=total)
        rows = self._ctx.entries.relatives(plan) if self._ctx.format.bases else []
        if any(same_params(index, plan) for _, _, index in rows):
            # The same params were stored under another rendering: the prompt moved (a
            # template that renders the date). A miss of its own kind, never a quarantine.
            self._ctx.count(prefix_moved=1)
            log.info("the rendered prompt prefix changed since it was cached (e.g. a date "
                     "in the chat template): a miss, prefilling it again")
        based = self._ctx.entries.from_base(plan, rows) if rows else None
        known = {entry_id for entry_id, _, _ in rows}
        later: list[Staged] = []  # checkpoints, put once this entry is committed
        base_where, extends = "", False
        base_id: str | None = None
        if based is not None:
            cache, keep, base_id, base_where, extends = based
            try:
                cache = self.extend_through(plan, cache, keep, known, later)
                source, computed, reused = "incremental", total - keep, keep
            except Exception as exc:  # a base the model cannot extend: start over cold
                log.warning("incremental prefill on a base failed, prefilling cold: %s",
                            reason(exc))
                based = None
        if based is None:
            cache = self.prefill_with_snapshot(plan, known, later)
            base_id, source, computed, reused = None, "cold", total, 0
        if not self.still(plan):  # switched mid-prefill: a cache of no one model state
            log.warning("the model changed during a prefill (adapters switched?): that cache "
                        "is dropped and the query runs cold")
            return CacheHandle.empty(), None
        # Only a base this entry strictly extends is superseded; a sibling that shares a
        # shorter prefix (the system message) stays. A base a live handle
        # of this controller holds is released later, once nobody holds it.
        supersedes = base_id if extends and computed > 0 else None
        with self._ctx.lock:
            deferred = supersedes is not None and self._ctx.book.held(supersedes)
        persisted = self.commit(plan, cache, None if deferred else supersedes)
        for staged in later:  # after this entry's own write: the request's comes first
            self._puts.submit(staged)
        self.remember(plan, Loaded(cache, plan.prefix))
        written = computed if persisted else 0
        with self._ctx.lock:
            if source == "cold":
                self._ctx.stats.cold_prefills += 1
            else:
                self._ctx.stats.incremental_prefills += 1
            self._ctx.stats.tokens_written += written
            self._ctx.stats.tokens_reused += reused
            if supersedes is not None and persisted:
                if deferred:
                    self._ctx.superseded[supersedes] = plan.entry_id
                else:
                    # The commit released the base (supersedes); ours to delete at close.
                    self._ctx.released.add(supersedes)
                    self._ctx.memory.pop(supersedes, None)
        work = PrepareWork(memory=reused if base_where == "memory" else 0,
                           disk=reused if base_where == "disk" else 0,
                           computed=computed, written=written)
        return self.handle(plan, source=source, written=written, reused=reused,
                            computed=computed,
                            supersedes=supersedes if persisted else None), work

    def prefill_with_snapshot(self, plan: Plan, known: set[str] | frozenset[str] = frozenset(),
                              later: list[Staged] | None = None) -> Any:
        """A cold prefill of ``plan``; for caches that cannot be cut back it runs through the
        instructions first and commits that state as an entry of its own (a snapshot that
        later prefills extend and never supersede), then extends a copy through the plan's
        checkpoints (``extend_through``). ``known``: ids already stored (not written again);
        ``later``: where the checkpoints are staged (None: put now, in the background)."""
        snap = snapshot_plan(self._ctx.format, plan)
        if snap is None:
            return self.extend_through(plan, None, 0, known, later)
        try:
            # No key lock of its own (a second stripe lock could wait on the one held):
            # a put of an entry that exists is a no-op, so racing writers are harmless.
            ctx = self._ctx
            done, stored = ctx.entries.on_disk(lambda: ctx.store.lookup(
                ctx.kind, snap.namespace, snap.key, touch=False, tenant=ctx.tenancy.tenant),
                ctx.deadlines.lookup_deadline_s)
            rest = len(plan.prefix) - len(snap.prefix)
            # Extending the snapshot costs more than one cold forward of the whole prefix.
            recompute = self.recompute_cheaper(len(snap.prefix), rest)
            if recompute and (not done or stored is not None):
                return self._ctx.format.prefill(plan)  # the snapshot is stored already
            head = self._ctx.format.prefill(snap)
            if done and stored is None and self.still(snap):
                self.commit(snap, head, None, snapshot=True)
            self.remember(snap, Loaded(head, snap.prefix))
            if recompute:
                return self._ctx.format.prefill(plan)
            ops = base_ops(self._ctx.format)
            return self.extend_through(plan, ops.clone(head), len(snap.prefix), known, later)
        except (SpoolError, ValueError, RuntimeError) as exc:
            if isinstance(exc, ConfigError):
                raise
            log.warning("instructions snapshot skipped: %s", reason(exc))
            return self._ctx.format.prefill(plan)

    def recompute_cheaper(self, held: int, new: int) -> bool:
        rule = getattr(self._ctx.format, "recompute_cheaper", None)
        return bool(rule(held, new)) if callable(rule) else False

    def extend_through(self, plan: Plan, cache: Any | None, start: int,
                       known: set[str] | frozenset[str],
                       later: list[Staged] | None = None) -> Any:
        """``cache`` (the state of the plan's first ``start`` ids; None: no state yet)
        extended to the whole prefix. A cache that cannot be cut back commits its state at
        each checkpoint past ``start`` on the way (``checkpoint_positions``; entries of their
        own, never superseded, staged into ``later`` or else handed to the background
        writer at once), so a prompt sharing only part of this one later restores the
        nearest checkpoint at or before the ids it shares instead of running cold."""
        tokens = list(plan.prefix.tokens)
        fmt = self._ctx.format
        at = start
        for count in checkpoint_positions(fmt, plan.prefix):
            if count <= start:
                continue
            cut = checkpoint_plan(plan, count, self._ctx.tenancy.entry_id)
            cache = fmt.prefill(cut) if cache is None else \
                base_ops(fmt).extend(cache, tokens[at:count])
            at = count
            if cut.entry_id not in known and self.still(cut) and not self._ctx.deadlines.down:
                staged = self._ctx.entries.stage(cut, cache, None, snapshot=True,
                                                 checkpoint=True)
                if staged is None:
                    continue
                if later is not None:
                    later.append(staged)
                elif not self._puts.submit(staged):
                    continue
                # the staged bytes may view this cache's tensors: go on on a copy
                cache = base_ops(fmt).clone(cache)
        if cache is None:
            return fmt.prefill(plan)
        return base_ops(fmt).extend(cache, tokens[at:]) if at < len(tokens) else cache

    def still(self, plan: Plan) -> bool:
        """Whether the model is still in the state ``plan`` was made in (formats whose model
        cannot change always are)."""
        still = getattr(self._ctx.format, "still", None)
        return bool(still(plan)) if callable(still) else True

    def commit(self, plan: Plan, cache: Any, base_id: str | None, *,
                snapshot: bool = False, checkpoint: bool = False) -> bool:
        if not self._ctx.entries.commit(plan, cache, base_id, snapshot=snapshot,
                                        checkpoint=checkpoint):
            return False
        with self._ctx.lock:
            # A commit revives an entry this controller had released earlier.
            self._ctx.released.discard(plan.entry_id)
        return True

    def remember(self, plan: Plan, loaded: Loaded) -> None:
        with self._ctx.lock:
            self._ctx.book.know(plan.entry_id, plan.params)
            if self._ctx.memory_entries() == 0:
                return
            self._ctx.memory[plan.entry_id] = loaded
            self._ctx.memory.move_to_end(plan.entry_id)
            while len(self._ctx.memory) > self._ctx.memory_entries():
                self._ctx.memory.popitem(last=False)

    def store_imported(self, params: CachePrepareParams, plan: Plan, cache: Any
                        ) -> CacheHandle:
        """Commit ``cache`` (checked and copied by ``import_cache``) as ``plan``'s entry,
        keep it loaded, and return its handle (``source="import"``)."""
        with self.key_lock(plan.entry_id):
            persisted = self.commit(plan, cache, None)
        self.remember(plan, Loaded(cache, plan.prefix))
        written = len(plan.prefix) if persisted else 0
        return self._ctx.book.stamp(params, self.handle(plan, source="import", written=written),
                                None)
