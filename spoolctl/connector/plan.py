"""Scheduler-side planning of restores and stores (pure; no I/O, no vLLM).

The scheduler connector feeds the ``Planner`` what vLLM tells it (lookups, block
allocations, scheduled token counts) and gets back the chunk loads and stores
for the step. Loads are planned once, into the blocks allocated for the hit;
a chunk is stored in the step in which its last prompt token is computed, if
it was not already present in the store when the request was looked up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .chain import longest_run


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
    load_range: tuple[int, int] | None = None
    next_store: int = 0


class Planner:
    """Per-request planning state of one scheduler. Not thread-safe (the scheduler is not)."""

    def __init__(self, *, chunk_tokens: int, block_size: int):
        if block_size <= 0 or chunk_tokens <= 0 or chunk_tokens % block_size:
            raise ValueError("chunk_tokens must be a positive multiple of block_size")
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.blocks_per_chunk = chunk_tokens // block_size
        self.requests: dict[str, RequestPlan] = {}

    def lookup(
        self, req_id: str, keys: Sequence[str], present: Sequence[bool],
        num_prompt_tokens: int, num_computed: int,
    ) -> int:
        """Record a lookup; return the tokens to load beyond ``num_computed``.

        The hit is the run of present chunks from the start, cut so that at least one
        prompt token is left to compute (vLLM needs one to sample from). When the prompt
        ends exactly on a chunk boundary and that last chunk is present, everything but the
        last token is loaded: the whole chunk is copied and vLLM's forward overwrites the
        last token's slot.
        """
        if len(keys) != len(present):
            raise ValueError("keys and present must have the same length")
        run = longest_run(present)
        usable = max(0, (num_prompt_tokens - 1) // self.chunk_tokens)
        hit_tokens = min(run, usable) * self.chunk_tokens
        if run > usable and num_prompt_tokens > 1 and \
                num_prompt_tokens == (usable + 1) * self.chunk_tokens:
            hit_tokens = num_prompt_tokens - 1
        self.requests[req_id] = RequestPlan(
            keys=list(keys), present=list(present), num_prompt_tokens=num_prompt_tokens,
            lookup_computed=num_computed)
        return max(0, hit_tokens - num_computed)

    def allocated(self, req_id: str, num_external_tokens: int) -> None:
        """vLLM allocated blocks; ``num_external_tokens`` > 0 means a load is due."""
        plan = self.requests.get(req_id)
        if plan is None:
            return
        if num_external_tokens > 0:
            start = plan.lookup_computed
            plan.load_range = (start, start + num_external_tokens)
        else:
            plan.load_range = None

    def scheduled(
        self, req_id: str, block_ids: Sequence[int] | None, *, replace: bool, computed_after: int,
    ) -> tuple[list[ChunkLoad], list[ChunkStore]]:
        """The request runs this step. ``block_ids`` are its blocks (``replace``) or new blocks
        to append; ``computed_after`` is its computed token count at the end of the step."""
        plan = self.requests.get(req_id)
        if plan is None:
            return [], []
        if block_ids is not None:
            if replace:
                plan.block_ids = list(block_ids)
            else:
                plan.block_ids.extend(block_ids)
        loads = self._loads(req_id, plan)
        return loads, self._stores(req_id, plan, computed_after)

    def _blocks_of(self, plan: RequestPlan, index: int) -> tuple[int, ...] | None:
        lo = index * self.blocks_per_chunk
        hi = lo + self.blocks_per_chunk
        if len(plan.block_ids) < hi:
            return None
        return tuple(plan.block_ids[lo:hi])

    def _loads(self, req_id: str, plan: RequestPlan) -> list[ChunkLoad]:
        if plan.load_range is None:
            return []
        start, end = plan.load_range
        plan.load_range = None
        loads = []
        # A load may end inside its last chunk (prompt's last token): copy that whole chunk.
        for index in range(start // self.chunk_tokens, -(-end // self.chunk_tokens)):
            blocks = self._blocks_of(plan, index)
            if blocks is None:  # vLLM did not allocate what it asked for: load nothing more
                break
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
