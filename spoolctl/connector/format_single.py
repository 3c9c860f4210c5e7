"""The single format: one full-attention KV cache group, one object ``kv`` per chunk.

A chunk entry holds the chunk's ``chunk_tokens / block_size`` blocks of every layer in
one object (layer-major, ``kvio``). Restores run synchronously in ``start_load_kv``,
before the forward; a request's chunks are restored in order and on the first failure
that chunk's and every later chunk's blocks are reported through
``get_block_ids_with_load_errors`` (vLLM truncates the request at the first failed block
and recomputes from there). See ``formats`` for the interface.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from spoolctl import metrics as m

from .formats import Capture, Captured, Copier, KVFormat, Planning
from .plan import ChunkLoad, Planner, ScheduledStep
from .stats import ConnectorCounters

if TYPE_CHECKING:
    import torch

    from spoolctl.store import Store

    from .kvio import CopyEngine, PagedKV
    from .layouts import LayerDecl
    from .messages import SpoolConnectorMetadata
    from .restore import ChunkRestore, RestorePipeline

OBJECT = "kv"


class SingleFormat(KVFormat):
    name = "single"
    load_async = False

    def __init__(self, chunk_tokens: int, block_size: int):
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size

    def planning(self) -> SinglePlanning:
        return SinglePlanning(Planner(chunk_tokens=self.chunk_tokens, block_size=self.block_size))

    def copier(self, counters: ConnectorCounters) -> SingleCopier:
        return SingleCopier(counters, blocks_per_chunk=self.chunk_tokens // self.block_size)


class SinglePlanning(Planning):
    planner: Planner

    def allocated(self, req_id: str, blocks: Any, num_external_tokens: int) -> None:
        self.planner.allocated(req_id, num_external_tokens)

    def plan_step(self, steps: Iterable[ScheduledStep], meta: SpoolConnectorMetadata) -> None:
        for step in steps:
            loads, stores = self.planner.scheduled(
                step.req_id, step.tables[0] if step.tables else None, replace=step.first,
                computed_after=step.computed_after)
            meta.loads += loads
            meta.stores += stores


class SingleCopier(Copier):
    def __init__(self, counters: ConnectorCounters, *, blocks_per_chunk: int):
        super().__init__(counters)
        self._blocks_per_chunk = blocks_per_chunk
        self._kv: PagedKV | None = None

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
        if not meta.loads:
            return
        if self._kv is None or pipeline is None:
            # Cannot happen when the scheduler only plans against ranks that reported; if it
            # does, the target blocks hold garbage: have vLLM recompute them.
            for load in meta.loads:
                self._failed_blocks.update(load.target_blocks)
            self._counters.inc(m.LOAD_ERRORS, len(meta.loads), reason="unknown")
            return
        by_req: dict[str, list[ChunkLoad]] = {}
        for load in meta.loads:
            by_req.setdefault(load.req_id, []).append(load)
        for loads in by_req.values():
            self._restore_request(sorted(loads, key=lambda ld: ld.index), pipeline)

    def _restore_request(self, loads: list[ChunkLoad], pipeline: RestorePipeline) -> None:
        """Restore a request's chunks in order. On the first failure this chunk and every
        later one are recomputed by vLLM (it truncates the request at the first failed
        block): report all their blocks, load nothing more."""
        failed_at = pipeline.run([self._chunk_restore(load) for load in loads])
        if failed_at is not None:
            for rest in loads[failed_at:]:
                self._failed_blocks.update(rest.target_blocks)

    def _chunk_restore(self, load: ChunkLoad) -> ChunkRestore:
        from .restore import ChunkRestore

        kv = self._kv
        assert kv is not None

        def valid(manifest: Any) -> bool:
            return manifest.meta.get("layout") == kv.layout_digest and \
                manifest.object(OBJECT).size == kv.chunk_bytes

        def fill(store: Store, manifest: Any, buf: torch.Tensor) -> int:
            store.read(manifest, OBJECT, into=memoryview(buf.numpy()))
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
                return {OBJECT: memoryview(buf.numpy())}, handle

            yield op.key, op.index, fill
