"""Which chunks each rank holds, reported to the scheduler over vLLM's own channels (pure).

On one host the scheduler reads every rank's catalog directly (``topology``). Across
hosts it cannot, so each worker tells it: a full inventory in its startup handshake
(``get_handshake_metadata``), then bounded per-step changes in its worker metadata
(``build_connector_worker_meta``), all aggregated by vLLM. The scheduler answers with
acknowledgements in the connector metadata it sends every worker each step.

Protocol (one ``RankInventory`` per worker, one ``InventoryView`` in the scheduler):

* **Epochs.** Every worker start has a new, larger ``epoch`` (persisted per rank root).
  A report from an older epoch than the one the scheduler follows is dropped; a newer
  epoch replaces everything the scheduler knew about that rank, so a restarted rank can
  never leave old entries looking present.
* **Sequence numbers.** Reports of one epoch are numbered 0, 1, 2, ...; a report that
  is not the next one (a gap) makes the scheduler forget the rank's keys and ask for a
  *reset* (a report that restates the inventory from empty). Until it arrives the
  rank's chunks are misses: fail closed. A worker whose last report stays
  unacknowledged sends an empty one after a few quiet steps, so a lost *last* report
  is noticed too.
* **Bounded reports.** A report carries at most ``limit`` keys (handshake:
  ``HANDSHAKE_MAX_KEYS``, per step: ``STEP_MAX_KEYS``); withdrawals go first, the rest
  of a large inventory follows in later steps. Keys travel as 32 raw bytes.
* **Withdraw before delete.** A worker that wants to delete an entry (capacity) first
  withdraws it: the removal is reported, and the worker deletes only after the
  scheduler acknowledged that report. Every plan the scheduler built before applying
  the withdrawal reaches the worker before the acknowledgement does, so no request is
  ever planned against a chunk that is already gone. Entries lost behind the
  connector's back (an operator's ``clean``, scrub quarantine, a failed read) are
  withdrawn when noticed; a load planned in between fails verification and vLLM
  recomputes it on every rank.
* **Withdrawn on every rank.** A chunk one rank withdrew is useless on the others (the
  quorum makes it a miss everywhere): the scheduler asks every rank to drop it too
  (``InventoryView.take_drops``, sent in the step metadata), so that a capacity or host
  budget eviction on one rank frees the same chunk on all of them.
* **More to say.** A report says whether its rank still has unsent changes (``more``): an
  idle engine keeps stepping until they are out (``InventoryView.busy``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

HANDSHAKE_MAX_KEYS = 16384
STEP_MAX_KEYS = 1024
# Quiet report() calls with an unacknowledged report outstanding before an empty report
# is sent anyway: if the last report was lost, the empty one reveals the gap.
HEARTBEAT_AFTER = 4
KEY_BYTES = 32


def key_bytes(key: str) -> bytes:
    """A 64-hex chunk key as the 32 bytes a report carries."""
    raw = bytes.fromhex(key)
    if len(raw) != KEY_BYTES:
        raise ValueError("chunk keys are 32 bytes")
    return raw


@dataclass(frozen=True)
class InventoryReport:
    """One rank's inventory change. ``reset``: forget earlier reports of this rank first."""

    rank: int
    epoch: int
    seq: int
    added: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    reset: bool = False
    more: bool = False  # the rank has changes this report could not carry

    def __post_init__(self) -> None:
        if self.rank < 0 or self.epoch <= 0 or self.seq < 0:
            raise ValueError("rank, epoch and seq must be non-negative (epoch positive)")
        if any(len(k) != KEY_BYTES for k in (*self.added, *self.removed)):
            raise ValueError("report keys must be 32 bytes")

    @property
    def size(self) -> int:
        return len(self.added) + len(self.removed)


@dataclass(frozen=True)
class Ack:
    """The scheduler has applied every report of ``epoch`` up to and including ``seq``."""

    epoch: int
    seq: int


class RankInventory:
    """A worker's side: what its store holds vs what the scheduler was told.

    Not thread-safe; the caller serialises access (the connector holds one lock).
    """

    def __init__(self, rank: int, epoch: int):
        if epoch <= 0:
            raise ValueError("epoch must be positive")
        self.rank = rank
        self.epoch = epoch
        self._held: set[bytes] = set()  # what the store holds, as far as we know
        self._told: set[bytes] = set()  # what the scheduler has been told (sent reports)
        self._seq = 0  # the next report's sequence number
        self._reset = True  # the next report restates the inventory from empty
        self._awaiting: dict[bytes, int] = {}  # withdrawn key -> seq of the report removing it
        # Reported removals not yet acknowledged: until then the scheduler may still count the
        # key (kept even if the key is re-added meanwhile, so a second withdrawal waits too).
        self._removal_seq: dict[bytes, int] = {}
        self._unsent_withdrawals: set[bytes] = set()  # in _told, no longer held
        self._unsent_adds: set[bytes] = set()  # held, not in _told (kept incrementally: the
        # per-step report must not cost O(inventory) on vLLM's engine loop)
        # Keys a scheduler may still count although _told no longer lists them: after a reset
        # is sent, what we had told before it; after a start, anything (a scheduler may still
        # hold a previous epoch's view). Retired by the ack of reset number _shadow_seq.
        self._shadow_all = True
        self._shadow: set[bytes] = set()
        self._shadow_seq = 0
        self._acked = -1  # the highest sequence number the scheduler acknowledged
        self._quiet = 0  # report() calls with nothing to say since the last report

    # -- what the store holds ------------------------------------------------------------------

    def replace(self, keys: Iterable[bytes]) -> None:
        """The store's full inventory (a rescan): anything else is gone."""
        self._held = set(keys)
        self._unsent_adds = self._held - self._told
        self._unsent_withdrawals = (self._unsent_withdrawals | (self._told - self._held)) \
            & self._told

    def add(self, key: bytes) -> None:
        """A chunk was committed (or revived)."""
        self._held.add(key)
        self._awaiting.pop(key, None)
        self._unsent_withdrawals.discard(key)
        if key not in self._told:
            self._unsent_adds.add(key)

    def lost(self, key: bytes) -> None:
        """A chunk disappeared on its own (deleted, quarantined, failed to read)."""
        self._held.discard(key)
        self._unsent_adds.discard(key)
        if key in self._told:
            self._unsent_withdrawals.add(key)

    def withdraw(self, key: bytes) -> bool:
        """Stop offering ``key`` before deleting it. True: wait for ``acked`` to return it
        before deleting; False: the scheduler never heard of it, delete at once."""
        self._held.discard(key)
        self._unsent_adds.discard(key)
        if key in self._told:  # its removal is still to be reported
            self._unsent_withdrawals.add(key)
            self._awaiting.setdefault(key, -1)
            return True
        if key in self._awaiting:  # removal already reported: still waiting for the ack
            return True
        if key in self._removal_seq:  # removed once (then re-added), not yet acknowledged
            self._awaiting[key] = self._removal_seq[key]
            return True
        if self._shadow_all or key in self._shadow:
            # Not told since the last reset, but the scheduler may not have applied that reset
            # yet: wait until it has.
            self._awaiting[key] = self._shadow_seq
            return True
        return False

    def holds(self, key: bytes) -> bool:
        return key in self._held

    @property
    def held(self) -> frozenset[bytes]:
        """A copy of the held keys (O(n): for rescans and diagnostics, not per step)."""
        return frozenset(self._held)

    @property
    def held_count(self) -> int:
        return len(self._held)

    # -- reports and acknowledgements -------------------------------------------------------

    def report(self, limit: int) -> InventoryReport | None:
        """The next report (at most ``limit`` keys), or None when there is nothing to say."""
        if limit <= 0:
            raise ValueError("limit must be positive")
        reset = self._reset
        if reset:
            self._shadow |= self._told
            self._shadow_seq = self._seq
            self._told = set()
            self._unsent_adds = set(self._held)
            removed: list[bytes] = []
        else:
            removed = list(itertools.islice(self._unsent_withdrawals, limit))
        room = limit - len(removed)
        added = list(itertools.islice(self._unsent_adds, room)) if room > 0 else []
        if not reset and not removed and not added:
            if self._acked >= self._seq - 1:
                return None
            self._quiet += 1
            if self._quiet < HEARTBEAT_AFTER:
                return None
        self._quiet = 0
        seq = self._seq
        self._seq += 1
        self._reset = False
        for key in removed:
            self._told.discard(key)
        self._told.update(added)
        self._unsent_adds.difference_update(added)
        sent = set(removed) if not reset else set(self._unsent_withdrawals)
        for key in sent:
            self._unsent_withdrawals.discard(key)
            self._removal_seq[key] = seq
            if key in self._awaiting:
                self._awaiting[key] = seq
        return InventoryReport(self.rank, self.epoch, seq, tuple(added), tuple(removed),
                               reset=reset,
                               more=bool(self._unsent_adds or self._unsent_withdrawals))

    def acked(self, ack: Ack) -> list[bytes]:
        """Apply an acknowledgement; return the withdrawn keys that may now be deleted."""
        if ack.epoch != self.epoch:
            return []
        self._acked = max(self._acked, ack.seq)
        if ack.seq >= self._shadow_seq:
            self._shadow_all = False
            self._shadow.clear()
        for key in [k for k, seq in self._removal_seq.items() if seq <= ack.seq]:
            del self._removal_seq[key]
        done = [k for k, seq in self._awaiting.items() if 0 <= seq <= ack.seq]
        for key in done:
            del self._awaiting[key]
        return done

    def expire(self, key: bytes) -> None:
        """Give up waiting for ``key``'s acknowledgement (the caller deletes it anyway)."""
        self._awaiting.pop(key, None)

    def resync(self) -> None:
        """The scheduler lost track: the next report restates everything."""
        self._reset = True

    @property
    def awaiting(self) -> int:
        """Withdrawn keys not yet acknowledged."""
        return len(self._awaiting)

    def consistent(self) -> bool:
        """Whether the incrementally kept sets match their definitions: the unsent additions
        are the held keys the scheduler was not told, the unsent withdrawals are told keys.
        O(inventory): for tests and diagnostics, not per step."""
        return self._unsent_adds == self._held - self._told \
            and self._unsent_withdrawals <= self._told


@dataclass
class _RankState:
    epoch: int
    next_seq: int
    keys: set[bytes] = field(default_factory=set)
    synced: bool = True
    more: bool = False  # its last report said more changes follow


@dataclass(frozen=True)
class Applied:
    """What applying one report changed in the scheduler's view of ``rank``.

    ``kind``: "delta" (``added``/``removed`` applied), "reset" (the rank restated its
    inventory from ``added``; more may follow), "forgotten" (a gap: the rank's keys are
    unknown until it restates them) or "dropped" (stale or duplicate: nothing changed).
    """

    rank: int
    kind: str
    added: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()


# Chunks remembered as already dropped on every rank (not asked for again).
DROP_MEMORY = 8192


class InventoryView:
    """The scheduler's side: the reported inventory of every remote rank.

    ``ranks``: every rank of the deployment (``has_all`` needs them all; a rank never heard
    of holds nothing).
    """

    def __init__(self, ranks: Iterable[int] = ()) -> None:
        self._all = tuple(ranks)
        self._ranks: dict[int, _RankState] = {}
        self._resync: dict[int, int] = {}  # rank -> epoch asked to reset
        self._drops: dict[bytes, None] = {}  # chunks every rank should drop (ordered set)
        self._dropped: OrderedDict[bytes, None] = OrderedDict()  # asked already
        self.dropped = 0  # stale or out-of-order reports ignored (diagnostics)

    def apply(self, report: InventoryReport) -> Applied:
        state = self._ranks.get(report.rank)
        if state is not None and report.epoch < state.epoch:
            self.dropped += 1
            return Applied(report.rank, "dropped")  # a report from before the rank restarted
        if report.reset:
            if state is not None and report.epoch == state.epoch and report.seq < state.next_seq:
                self.dropped += 1
                return Applied(report.rank, "dropped")  # a duplicate of a reset already applied
            keys = set(report.added) - set(report.removed)
            self._ranks[report.rank] = _RankState(report.epoch, report.seq + 1, keys,
                                                  more=report.more)
            self._resync.pop(report.rank, None)
            return Applied(report.rank, "reset", tuple(keys))
        if state is None or report.epoch > state.epoch or report.seq > state.next_seq:
            # A rank we never saw reset, a restart whose first report we missed, or a
            # gap: what we know is unreliable. Forget it and ask for a restatement.
            epoch = report.epoch if state is None else max(state.epoch, report.epoch)
            self._ranks[report.rank] = _RankState(
                epoch, state.next_seq if state is not None and epoch == state.epoch else 0,
                synced=False)
            self._resync[report.rank] = epoch
            self.dropped += 1
            return Applied(report.rank, "forgotten")
        if report.seq < state.next_seq or not state.synced:
            self.dropped += 1
            return Applied(report.rank, "dropped")  # a duplicate, or waiting for our reset
        state.keys.difference_update(report.removed)
        state.keys.update(report.added)
        state.next_seq = report.seq + 1
        state.more = report.more
        self._note_drops(report.rank, report.removed)
        return Applied(report.rank, "delta", report.added, report.removed)

    def _note_drops(self, rank: int, removed: Iterable[bytes]) -> None:
        """A chunk ``rank`` withdrew that other ranks still hold: every rank should drop it."""
        for key in removed:
            if key in self._dropped or key in self._drops:
                continue
            if any(r != rank and s.synced and key in s.keys for r, s in self._ranks.items()):
                self._drops[key] = None

    def take_drops(self, limit: int) -> list[bytes]:
        """Up to ``limit`` chunks every rank should drop (each asked for once)."""
        out = []
        for key in list(self._drops)[:limit]:
            del self._drops[key]
            self._dropped[key] = None
            out.append(key)
        while len(self._dropped) > DROP_MEMORY:
            self._dropped.popitem(last=False)
        return out

    def has(self, rank: int, keys: Iterable[bytes]) -> list[bool]:
        state = self._ranks.get(rank)
        if state is None or not state.synced:
            return [False for _ in keys]
        return [k in state.keys for k in keys]

    def holds(self, rank: int, key: bytes) -> bool:
        state = self._ranks.get(rank)
        return state is not None and state.synced and key in state.keys

    def has_all(self, key: bytes) -> bool:
        """Whether every rank of the deployment reported ``key`` (the quorum)."""
        return bool(self._all) and all(self.holds(r, key) for r in self._all)

    def settled(self, rank: int) -> bool:
        """Whether ``rank``'s reported inventory is complete (synced, nothing more due)."""
        state = self._ranks.get(rank)
        return state is not None and state.synced and not state.more

    def busy(self) -> bool:
        """Whether reports are still due: a rank said more follows, a reset is awaited, or
        drops are waiting to be sent."""
        return bool(self._resync or self._drops) or any(s.more for s in self._ranks.values())

    def acks(self) -> dict[int, Ack]:
        """What to acknowledge to each rank: the last report applied in its epoch."""
        return {rank: Ack(s.epoch, s.next_seq - 1)
                for rank, s in self._ranks.items() if s.synced and s.next_seq > 0}

    def resync_requests(self) -> dict[int, int]:
        """Ranks (-> epoch) whose next report must be a reset."""
        return dict(self._resync)

    def known(self, rank: int) -> int:
        """How many chunks ``rank`` is known to hold (0 when unknown or resyncing)."""
        state = self._ranks.get(rank)
        return len(state.keys) if state is not None and state.synced else 0


def resync_for(requests: Mapping[int, int], rank: int, epoch: int) -> bool:
    """Whether a scheduler's resync requests ask this rank (in this epoch) to reset."""
    return requests.get(rank) == epoch
