"""The single format: one full-attention KV cache group, one object ``kv`` per chunk.

A chunk entry holds the chunk's ``chunk_tokens / block_size`` blocks of every layer in
one object (layer-major, ``kvio``). Restores are asynchronous for vLLM (``load_kv_async``):
planned when vLLM allocates the hit's blocks, begun in ``start_load_kv`` (with the KV cache
in host memory: when vLLM binds the step's metadata, before the forward; reads and
verification on helper threads, ``restore.RestorePipeline``), copied into the KV blocks
at the engine's safe points while other requests run, and reported per request in
``get_transfer_results`` once every chunk is in place. A request's chunks are copied in
order; on the first failure that chunk's and every later chunk's blocks are reported
through ``get_block_ids_with_load_errors`` in the same step (vLLM truncates the request
at the first failed block and recomputes from there; the scheduler does not restore it
again). See ``formats`` for the interface.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from spoolctl import metrics as m
from spoolctl.store import plain_size

from ..planning.plan import ChunkLoad, Planner, ScheduledStep, SingleRequestLoad
from ..stats import ConnectorCounters
from .formats import Capture, Captured, ChunkRestore, Copier, KVFormat, Planning
from .formats import Restorer as RestorePipeline

if TYPE_CHECKING:
    import torch

    from spoolctl.store import Manifest, Store

    from ..planning.messages import SpoolConnectorMetadata
    from ..vllm_api.protocols import KVCacheBlocksLike
    from .kvio import CopyEngine, PagedKV
    from .layouts import LayerDecl

OBJECT = "kv"
# With nothing else to run, the engine waits this long per step for restores to progress
# (instead of spinning through empty steps on the core the reads need); short, so new
# requests are admitted without noticeable delay.
IDLE_WAIT_S = 0.02


class SingleFormat(KVFormat):
    name = "single"
    load_async = True

    def __init__(self, chunk_tokens: int, block_size: int):
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size

    def planning(self) -> SinglePlanning:
        return SinglePlanning(Planner(chunk_tokens=self.chunk_tokens, block_size=self.block_size))

    def copier(self, counters: ConnectorCounters) -> SingleCopier:
        return SingleCopier(counters, blocks_per_chunk=self.chunk_tokens // self.block_size)


class SinglePlanning(Planning):
    planner: Planner

    def __init__(self, planner: Planner):
        super().__init__(planner)
        # Requests restoring now: the blocks they load (to tell which of them failed).
        self._loading: dict[str, frozenset[int]] = {}

    def allocated(self, req_id: str, blocks: KVCacheBlocksLike,
                  num_external_tokens: int) -> None:
        table = blocks.get_block_ids()[0] if num_external_tokens > 0 else None
        self.planner.allocated(req_id, table, num_external_tokens)

    def plan_step(self, steps: Iterable[ScheduledStep], meta: SpoolConnectorMetadata) -> None:
        meta.loads = self.planner.take_loads()
        for load in meta.loads:
            self._loading[load.req_id] = load.target_blocks
        for step in steps:
            meta.stores += self.planner.scheduled(
                step.req_id, step.tables[0] if step.tables else None, replace=step.first,
                computed_after=step.computed_after)

    def load_failures(self, finished: set[str], failed: set[str],
                      invalid_blocks: set[int]) -> set[str]:
        """Failed requests, and those whose restore reported a failed block."""
        out = set(failed)
        if invalid_blocks:
            out |= {r for r, blocks in self._loading.items() if blocks & invalid_blocks}
        for req_id in finished | failed:
            self._loading.pop(req_id, None)
        return out

    def finished(self, req_id: str) -> None:
        super().finished(req_id)
        self._loading.pop(req_id, None)


class SingleCopier(Copier):
    def __init__(self, counters: ConnectorCounters, *, blocks_per_chunk: int):
        super().__init__(counters)
        self._blocks_per_chunk = blocks_per_chunk
        self._kv: PagedKV | None = None
        self._restoring: dict[str, SingleRequestLoad] = {}

    def bind(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int | None, *,
             declared: Mapping[str, LayerDecl] | None = None,
             engine: CopyEngine | None = None) -> None:
        from .kvio import PagedKV

        kv = PagedKV(kv_caches, num_blocks=num_blocks, blocks_per_chunk=self._blocks_per_chunk,
                     declared=declared, engine=engine, asynchronous=True)
        self.chunk_bytes, self.layout_json = kv.chunk_bytes, kv.layout_json
        self.layout_digest = kv.layout_digest
        self._kv = kv

    def restore(self, meta: SpoolConnectorMetadata, pipeline: RestorePipeline | None) -> None:
        """Begin this step's planned restores; ``poll`` copies and reports them."""
        for req in meta.loads:
            if not req.ok or self._kv is None or pipeline is None:
                # No plan (vLLM allocated less than the hit), or nothing to copy into (cannot
                # happen when the scheduler only plans against ranks that reported): the
                # target blocks hold garbage, have vLLM recompute them.
                self._counters.inc(m.LOAD_ERRORS, reason="unknown")
                self._fail(req, 0, "unknown")
                continue
            self._restoring[req.req_id] = req
            pipeline.begin(req.req_id, [self._chunk_restore(load) for load in req.loads])

    def poll(self, pipeline: RestorePipeline | None, finished: set[str], *,
             idle: bool) -> None:
        """Copy what was read (a safe point), and record the restores that ended."""
        if pipeline is None or not self._restoring:
            return
        gone = finished & self._restoring.keys()
        if gone:
            pipeline.cancel(gone)
        for req_id, failed_at in pipeline.pump(wait_s=IDLE_WAIT_S if idle else 0.0):
            reason = pipeline.take_reason(req_id)
            req = self._restoring.pop(req_id, None)
            if req is None:
                continue
            if failed_at is None:
                self._recv_done.add(req_id)
            else:
                self._fail(req, failed_at, reason or "unknown")

    def _fail(self, req: SingleRequestLoad, failed_at: int, reason: str) -> None:
        """Report ``req`` finished with its chunks from ``failed_at`` on to recompute: in
        ``get_block_ids_with_load_errors`` in the same step (vLLM truncates the request at
        the first of them), or as failed when there is no block to name; ``reason`` (a
        ``load_errors_total`` reason) goes to the scheduler with the step's report."""
        self._recv_done.add(req.req_id)
        self._fail_reasons[req.req_id] = reason
        blocks = {b for load in req.loads[failed_at:] for b in load.target_blocks}
        if blocks:
            self._failed_blocks.update(blocks)
        else:
            self._recv_failed.add(req.req_id)

    def _chunk_restore(self, load: ChunkLoad) -> ChunkRestore:

        kv = self._kv
        assert kv is not None

        def valid(manifest: Manifest) -> bool:
            return manifest.meta.get("layout") == kv.layout_digest and \
                plain_size(manifest, OBJECT) == kv.chunk_bytes

        def fill(store: Store, manifest: Manifest, buf: torch.Tensor) -> int:
            # numpy's stubs give ndarray the buffer protocol on Python >= 3.12 only
            store.read(manifest, OBJECT, into=memoryview(buf.numpy()))  # type: ignore[arg-type]
            return kv.chunk_bytes

        return ChunkRestore(load.key, valid, fill,
                            lambda buf: kv.restore(buf, load.block_ids, load.skip))

    def captures(self, meta: SpoolConnectorMetadata) -> Iterator[Capture]:
        kv = self._kv
        if kv is None:
            return
        for op in meta.stores:
            def fill(buf: torch.Tensor, ids: tuple[int, ...] = op.block_ids) -> Captured:
                handle = kv.capture(ids, buf)
                # numpy's stubs give ndarray the buffer protocol on Python >= 3.12 only
                return {OBJECT: memoryview(buf.numpy())}, handle  # type: ignore[arg-type]

            yield op.key, op.index, fill
