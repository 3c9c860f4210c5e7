"""Scheduler-side planning of restores and stores (pure; no I/O, no vLLM).

The scheduler connector feeds the ``Planner`` what vLLM tells it (lookups, block
allocations, scheduled token counts) and gets back the chunk loads and stores
for the step. Loads are planned once, into the blocks allocated for the hit, when vLLM
allocates them (restores are asynchronous: the request waits until every worker reported
it); a chunk is stored in the step in which its last prompt token is computed, if
it was not already present in the store when the request was looked up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .chain import longest_run
from .groups import GroupLayout


class ScheduledStep(NamedTuple):
    """One request scheduled in one step (read from vLLM's ``SchedulerOutput`` by
    ``introspect.scheduled_requests``)."""

    req_id: str
    # Per KV cache group: the whole block table when ``first`` (a new or resumed request),
    # else the ids appended this step; None when nothing was appended.
    tables: Sequence[Sequence[int]] | None
    first: bool
    computed_before: int  # computed tokens before the step
    computed_after: int  # and after it


def hit_tokens(run: int, num_prompt_tokens: int, chunk_tokens: int) -> int:
    """Tokens of a hit of ``run`` present chunks from the start of a prompt.

    The hit is cut so that at least one prompt token is left to compute (vLLM needs one to
    sample from). When the prompt ends exactly on a chunk boundary and that last chunk is
    present, everything but the last token is loaded: the whole chunk is copied and vLLM's
    forward overwrites the last token's slot.
    """
    usable = max(0, (num_prompt_tokens - 1) // chunk_tokens)
    hit = min(run, usable) * chunk_tokens
    if run > usable and num_prompt_tokens > 1 and \
            num_prompt_tokens == (usable + 1) * chunk_tokens:
        hit = num_prompt_tokens - 1
    return hit


@dataclass(frozen=True)
class ChunkLoad:
    """Restore chunk ``index`` of ``req_id`` into ``block_ids[skip:]``.

    ``skip`` leading blocks are already computed locally and must not be overwritten.
    """

    req_id: str
    index: int
    key: str
    block_ids: tuple[int, ...]
    skip: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.skip < len(self.block_ids):
            raise ValueError("skip must leave at least one block to load")

    @property
    def target_blocks(self) -> tuple[int, ...]:
        return self.block_ids[self.skip:]


@dataclass(frozen=True)
class ChunkStore:
    """Capture chunk ``index`` of ``req_id`` from ``block_ids`` after this step's forward."""

    req_id: str
    index: int
    key: str
    block_ids: tuple[int, ...]


@dataclass
class RequestPlan:
    keys: list[str]
    present: list[bool]
    num_prompt_tokens: int
    lookup_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    next_store: int = 0


@dataclass(frozen=True)
class SingleRequestLoad:
    """One request's asynchronous restore: its chunk loads in prompt order. ``ok=False``:
    the plan could not be made (vLLM allocated fewer blocks than the hit needs); the worker
    reports the request as failed and vLLM recomputes it."""

    req_id: str
    loads: tuple[ChunkLoad, ...]
    ok: bool = True

    @property
    def target_blocks(self) -> frozenset[int]:
        return frozenset(b for ld in self.loads for b in ld.target_blocks)


class Planner:
    """Per-request planning state of one scheduler. Not thread-safe (the scheduler is not)."""

    def __init__(self, *, chunk_tokens: int, block_size: int):
        if block_size <= 0 or chunk_tokens <= 0 or chunk_tokens % block_size:
            raise ValueError("chunk_tokens must be a positive multiple of block_size")
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.blocks_per_chunk = chunk_tokens // block_size
        self.requests: dict[str, RequestPlan] = {}
        self._loads: list[SingleRequestLoad] = []

    def lookup(
        self, req_id: str, keys: Sequence[str], present: Sequence[bool],
        num_prompt_tokens: int, num_computed: int, *, restore: bool = True,
    ) -> int:
        """Record a lookup; return the tokens to load beyond ``num_computed`` (0 when
        ``restore`` is False: absent chunks are still stored). See ``hit_tokens``."""
        if len(keys) != len(present):
            raise ValueError("keys and present must have the same length")
        hit = hit_tokens(longest_run(present), num_prompt_tokens, self.chunk_tokens) \
            if restore else 0
        self.requests[req_id] = RequestPlan(
            keys=list(keys), present=list(present), num_prompt_tokens=num_prompt_tokens,
            lookup_computed=num_computed)
        return max(0, hit - num_computed)

    def allocated(self, req_id: str, block_ids: Sequence[int] | None,
                  num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks (``block_ids``: its whole table) for
        ``num_external_tokens`` tokens to restore beyond its lookup's computed tokens: plan
        the restore into them now (``take_loads`` hands it to the workers)."""
        plan = self.requests.get(req_id)
        if plan is None or num_external_tokens <= 0:
            return
        if block_ids is not None:
            plan.block_ids = list(block_ids)
        start = plan.lookup_computed
        loads = self._plan_loads(req_id, plan, start, start + num_external_tokens)
        self._loads.append(SingleRequestLoad(req_id, tuple(loads or ()), ok=loads is not None))

    def take_loads(self) -> list[SingleRequestLoad]:
        """The restores planned since the last call."""
        loads, self._loads = self._loads, []
        return loads

    def scheduled(
        self, req_id: str, block_ids: Sequence[int] | None, *, replace: bool, computed_after: int,
    ) -> list[ChunkStore]:
        """The request runs this step. ``block_ids`` are its blocks (``replace``) or new blocks
        to append; ``computed_after`` is its computed token count at the end of the step.
        Returns the chunks to capture after this step's forward."""
        plan = self.requests.get(req_id)
        if plan is None:
            return []
        if block_ids is not None:
            if replace:
                plan.block_ids = list(block_ids)
            else:
                plan.block_ids.extend(block_ids)
        return self._stores(req_id, plan, computed_after)

    def _blocks_of(self, plan: RequestPlan, index: int) -> tuple[int, ...] | None:
        lo = index * self.blocks_per_chunk
        hi = lo + self.blocks_per_chunk
        if len(plan.block_ids) < hi:
            return None
        return tuple(plan.block_ids[lo:hi])

    def _plan_loads(self, req_id: str, plan: RequestPlan, start: int,
                    end: int) -> list[ChunkLoad] | None:
        """Chunk loads for tokens ``[start, end)``; None if a chunk's blocks are missing."""
        loads = []
        # A load may end inside its last chunk (prompt's last token): copy that whole chunk.
        for index in range(start // self.chunk_tokens, -(-end // self.chunk_tokens)):
            blocks = self._blocks_of(plan, index)
            if blocks is None or index >= len(plan.keys):
                return None  # vLLM did not allocate what the hit needs: restore nothing
            skip = max(0, start - index * self.chunk_tokens) // self.block_size
            loads.append(ChunkLoad(req_id, index, plan.keys[index], blocks, skip))
        return loads

    def _stores(self, req_id: str, plan: RequestPlan, computed_after: int) -> list[ChunkStore]:
        stores = []
        done = min(computed_after, plan.num_prompt_tokens) // self.chunk_tokens
        while plan.next_store < min(done, len(plan.keys)):
            index = plan.next_store
            blocks = self._blocks_of(plan, index)
            if blocks is None:
                break
            plan.next_store += 1
            if not plan.present[index]:
                stores.append(ChunkStore(req_id, index, plan.keys[index], blocks))
        return stores

    def finished(self, req_id: str) -> None:
        self.requests.pop(req_id, None)


# -- grouped format (SupportsHMA: several KV cache groups, sliding windows) -------------------


@dataclass(frozen=True)
class GroupChunkLoad:
    """Restore chunk ``index``: ``targets[g]`` lists, for every stored block of group g's
    object, the block id to write it into (0 = leave alone), or is None when nothing of
    group g is needed from this chunk."""

    index: int
    key: str
    targets: tuple[tuple[int, ...] | None, ...]


@dataclass(frozen=True)
class RequestLoad:
    """One request's asynchronous restore. ``ok=False``: the plan could not be made (the
    worker reports the request as failed, vLLM recomputes it)."""

    req_id: str
    chunks: tuple[GroupChunkLoad, ...]
    ok: bool = True


@dataclass(frozen=True)
class GroupChunkStore:
    """Capture chunk ``index``: ``blocks[g]`` are the ids of group g's stored blocks."""

    req_id: str
    index: int
    key: str
    blocks: tuple[tuple[int, ...], ...]


@dataclass
class GroupedRequest:
    keys: list[str]
    present: list[bool]
    num_prompt_tokens: int
    lookup_computed: int = 0
    tables: list[list[int]] = field(default_factory=list)
    next_store: int = 0


class GroupedPlanner:
    """Planning for the grouped format (one object per KV cache group).

    Loads are planned from the block tables vLLM allocated for an external hit
    (``allocated``) and emitted in the same step (``take_loads``), asynchronously: the
    request waits in ``WAITING_FOR_REMOTE_KVS`` until every worker reported it. Every
    non-null block in ``[L / bs, cdiv(T / bs))`` of every group is filled (``L`` local
    hit, ``T`` local + external); vLLM leaves out-of-window sliding positions null.

    Stores capture chunk ``c`` only in the step whose computed range crosses its boundary
    ``B``: vLLM frees sliding blocks on the tokens processed *before* the step, so the
    chunk's in-window tail is still live. Chunks already computed when the request is
    first scheduled (a local prefix hit) are captured in that step only, and only when
    none of the ids is the null block; in any later step the connector's copy of the
    table may hold ids vLLM freed meanwhile.
    """

    def __init__(self, *, chunk_tokens: int, groups: Sequence[GroupLayout]):
        if chunk_tokens <= 0 or not groups:
            raise ValueError("a grouped planner needs a chunk size and groups")
        for g in groups:
            if chunk_tokens % g.block_size or g.blocks_per_chunk * g.block_size != chunk_tokens:
                raise ValueError("chunk_tokens must be a multiple of every group's block size")
        self.chunk_tokens = chunk_tokens
        self.groups = list(groups)
        self.requests: dict[str, GroupedRequest] = {}
        self._loads: list[RequestLoad] = []

    def lookup(self, req_id: str, keys: Sequence[str], present: Sequence[bool],
               num_prompt_tokens: int, num_computed: int, *, restore: bool = True) -> int:
        """Record a lookup; return the tokens to load beyond ``num_computed`` (0 when
        ``restore`` is False: absent chunks are still stored)."""
        if len(keys) != len(present):
            raise ValueError("keys and present must have the same length")
        hit = hit_tokens(longest_run(present), num_prompt_tokens, self.chunk_tokens) \
            if restore else 0
        self.requests[req_id] = GroupedRequest(
            keys=list(keys), present=list(present), num_prompt_tokens=num_prompt_tokens,
            lookup_computed=num_computed)
        return max(0, hit - num_computed)

    def allocated(self, req_id: str, tables: Sequence[Sequence[int]],
                  num_external_tokens: int) -> None:
        """vLLM allocated ``tables`` (one block id list per group, 0 = null block) for
        ``num_external_tokens`` external tokens; plan the request's restore."""
        plan = self.requests.get(req_id)
        if plan is None or num_external_tokens <= 0:
            return
        start = plan.lookup_computed
        end = start + num_external_tokens
        chunks = self._plan_load(plan, tables, start, end)
        self._loads.append(RequestLoad(req_id, tuple(chunks or ()), ok=chunks is not None))

    def _plan_load(self, plan: GroupedRequest, tables: Sequence[Sequence[int]], start: int,
                   end: int) -> list[GroupChunkLoad] | None:
        if len(tables) != len(self.groups):
            return None
        first_chunk, last_chunk = start // self.chunk_tokens, -(-end // self.chunk_tokens)
        if last_chunk > len(plan.keys):
            return None
        per_chunk: dict[int, list[list[int] | None]] = {}
        for gi, (g, table) in enumerate(zip(self.groups, tables, strict=True)):
            lo, hi = start // g.block_size, -(-end // g.block_size)
            if len(table) < hi:
                return None  # vLLM did not allocate what the hit needs
            for pos in range(lo, hi):
                block = int(table[pos])
                if block == 0:
                    continue  # null: out of the window (vLLM needs nothing there)
                index, offset = divmod(pos, g.blocks_per_chunk)
                slot = offset - g.first_stored
                if slot < 0:
                    return None  # not stored (cannot happen for hits ending at a boundary)
                targets = per_chunk.setdefault(index, [None] * len(self.groups))
                stored = targets[gi]
                if stored is None:
                    stored = targets[gi] = [0] * g.stored_blocks
                stored[slot] = block
        return [GroupChunkLoad(i, plan.keys[i], tuple(
                    None if t is None else tuple(t) for t in per_chunk[i]))
                for i in range(first_chunk, last_chunk) if i in per_chunk]

    def take_loads(self) -> list[RequestLoad]:
        loads, self._loads = self._loads, []
        return loads

    def scheduled(self, req_id: str, tables: Sequence[Sequence[int]] | None, *, replace: bool,
                  computed_before: int, computed_after: int,
                  first: bool) -> list[GroupChunkStore]:
        """The request runs this step. ``tables`` are its block tables per group
        (``replace``) or newly appended ids per group; ``first``: its first scheduled step
        (new or resumed), whose tables are complete and current."""
        plan = self.requests.get(req_id)
        if plan is None:
            return []
        if tables is not None and len(tables) == len(self.groups):
            if replace:
                plan.tables = [list(t) for t in tables]
            elif plan.tables:  # appended ids without a table to append to: ignored
                for mine, new in zip(plan.tables, tables, strict=True):
                    mine.extend(new)
        stores = []
        done = min(computed_after, plan.num_prompt_tokens) // self.chunk_tokens
        while plan.next_store < min(done, len(plan.keys)):
            index = plan.next_store
            boundary = (index + 1) * self.chunk_tokens
            allocated, blocks = self._blocks_of(plan, index)
            if not allocated and boundary > computed_before:
                break  # not allocated yet (cannot happen for computed tokens): try later
            plan.next_store += 1
            if plan.present[index] or blocks is None:
                continue  # present, or a null block where a stored page should be
            if boundary <= computed_before and not first:
                continue  # computed earlier: its ids may be stale by now
            stores.append(GroupChunkStore(req_id, index, plan.keys[index], blocks))
        return stores

    def _blocks_of(self, plan: GroupedRequest,
                   index: int) -> tuple[bool, tuple[tuple[int, ...], ...] | None]:
        """(allocated, the stored blocks' ids per group or None if any is the null block)."""
        if len(plan.tables) != len(self.groups):
            return False, None
        out = []
        for g, table in zip(self.groups, plan.tables, strict=True):
            hi = (index + 1) * g.blocks_per_chunk
            if len(table) < hi:
                return False, None
            out.append(tuple(int(b) for b in table[hi - g.stored_blocks:hi]))
        if any(0 in ids for ids in out):
            return True, None
        return True, tuple(out)

    def finished(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
