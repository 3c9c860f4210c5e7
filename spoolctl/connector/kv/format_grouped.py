"""The grouped format (``SupportsHMA``): one object per KV cache group and chunk.

Models with several KV cache groups or sliding windows (``groups``): a chunk entry holds
one object per group (``g<i>``; a sliding group only its in-window tail), each copied
through that group's own layers (vLLM overlays the groups in one buffer and a block id
means something only in its own group; the null block 0 is never read or written).
Restores are asynchronous for vLLM (``load_kv_async``): planned from the block tables
vLLM allocated (``plan.GroupedPlanner``), run in ``start_load_kv``, and every worker
reports each request in ``get_transfer_results``; a failed one is reported in
``failed_recving`` and vLLM recomputes it in full. A chunk is captured only in the step
that crosses its boundary. See ``formats`` for the interface.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from spoolctl import metrics as m
from spoolctl.errors import ConfigError
from spoolctl.store import hash_bytes, plain_size

from ..planning.groups import GroupInfo, GroupLayout
from ..planning.plan import (
    GroupChunkLoad,
    GroupChunkStore,
    GroupedPlanner,
    RequestLoad,
    ScheduledStep,
)
from ..stats import ConnectorCounters
from .formats import Capture, Captured, ChunkRestore, Copier, KVFormat, Planning
from .formats import Restorer as RestorePipeline

if TYPE_CHECKING:
    import torch

    from spoolctl.store import Manifest, Store

    from ..planning.messages import SpoolConnectorMetadata
    from ..vllm_api.protocols import KVCacheBlocksLike
    from .kvio import CopyEngine, CopyHandle, PagedKV
    from .layouts import LayerDecl

log = logging.getLogger("spoolctl.connector")

# One group's copy target: its layout, its layers' tensors, its offset in a chunk buffer.
_GroupKV = tuple[GroupLayout, "PagedKV", int]


class GroupedFormat(KVFormat):
    name = "grouped"
    load_async = True

    def __init__(self, chunk_tokens: int, groups: Sequence[GroupInfo],
                 layouts: Sequence[GroupLayout]):
        self.chunk_tokens = chunk_tokens
        self.groups = tuple(groups)
        self.layouts = tuple(layouts)

    def planning(self) -> GroupedPlanning:
        return GroupedPlanning(GroupedPlanner(chunk_tokens=self.chunk_tokens,
                                              groups=self.layouts))

    def copier(self, counters: ConnectorCounters) -> GroupedCopier:
        return GroupedCopier(counters, self.groups, self.layouts)


class GroupedPlanning(Planning):
    planner: GroupedPlanner

    def allocated(self, req_id: str, blocks: KVCacheBlocksLike,
                  num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self.planner.allocated(req_id, blocks.get_block_ids(), num_external_tokens)

    def plan_step(self, steps: Iterable[ScheduledStep], meta: SpoolConnectorMetadata) -> None:
        meta.request_loads = self.planner.take_loads()
        for step in steps:
            meta.group_stores += self.planner.scheduled(
                step.req_id, step.tables, replace=step.first,
                computed_before=step.computed_before, computed_after=step.computed_after,
                first=step.first)


class GroupedCopier(Copier):
    def __init__(self, counters: ConnectorCounters, groups: Sequence[GroupInfo],
                 layouts: Sequence[GroupLayout]):
        super().__init__(counters)
        self._groups = tuple(groups)
        self._layouts = tuple(layouts)
        self._gkv: list[_GroupKV] = []

    def bind(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int | None, *,
             declared: Mapping[str, LayerDecl] | None = None,
             engine: CopyEngine | None = None) -> None:
        """Per group, its layers' tensors, each with its offset in a chunk buffer. Groups
        overlay one memory buffer and a block id means something only in its own group's
        layers; KV-sharing alias layers (in ``kv_caches`` but in no group) are left out:
        their target layer is copied once."""
        from .kvio import PagedKV

        gkv, offset = [], 0
        for info, lay in zip(self._groups, self._layouts, strict=True):
            mine = {n: kv_caches[n] for n in info.layers if n in kv_caches}
            if not mine:
                raise ConfigError(
                    f"KV cache group {info.index} has no registered KV tensors",
                    path="kv_caches", fix='set "spoolctl_on_unsupported": "disable" to serve '
                                          "without the connector")
            kv = PagedKV(mine, num_blocks=num_blocks, blocks_per_chunk=lay.stored_blocks,
                         declared=declared, engine=engine, asynchronous=True)
            gkv.append((lay, kv, offset))
            offset += kv.chunk_bytes
        self._gkv = gkv
        self.chunk_bytes = offset
        self.layout_json = {"groups": [{**lay.to_json(), **kv.layout_json}
                                       for lay, kv, _ in gkv]}
        self.layout_digest = hash_bytes(json.dumps(
            self.layout_json, sort_keys=True, separators=(",", ":")).encode())

    def restore(self, meta: SpoolConnectorMetadata, pipeline: RestorePipeline | None) -> None:
        for req_load in meta.request_loads:
            # Every worker reports every request (vLLM waits for all of them); a failure
            # is reported as finished and failed, and vLLM recomputes the request.
            failure: str | None = "unknown"
            try:
                failure = self._restore_request(req_load, pipeline)
            except Exception:  # never let a cache problem take the worker down
                log.exception("spoolctl: unexpected restore error, recomputing")
            self._recv_done.add(req_load.req_id)
            if failure is not None:
                self._recv_failed.add(req_load.req_id)
                self._fail_reasons[req_load.req_id] = failure

    def _restore_request(self, load: RequestLoad,
                         pipeline: RestorePipeline | None) -> str | None:
        """Restore one request's chunks; None, or why it failed (a ``load_errors_total``
        reason)."""
        if not load.ok or not self._gkv or pipeline is None:
            self._counters.inc(m.LOAD_ERRORS, reason="unknown")
            return "unknown"
        items = []
        for chunk in load.chunks:
            if len(chunk.targets) != len(self._gkv):
                # A plan for another group layout: never restore from it.
                log.error("spoolctl: restore plan does not match the KV cache groups, "
                          "recomputing")
                self._counters.inc(m.LOAD_ERRORS, reason="unknown")
                return "unknown"
            items.append(self._chunk_restore(chunk))
        if pipeline.run(items, req_id=load.req_id) is None:
            return None
        return pipeline.take_reason(load.req_id) or "unknown"

    def _chunk_restore(self, chunk: GroupChunkLoad) -> ChunkRestore:
        """Read, verify and copy the objects of one chunk that the restore needs."""
        from .kvio import last

        wanted = [(lay, kv, off, targets) for (lay, kv, off), targets
                  in zip(self._gkv, chunk.targets, strict=True) if targets is not None]
        digest = self.layout_digest

        def valid(manifest: Manifest) -> bool:
            names = {ref.name for ref in manifest.objects}
            return manifest.meta.get("layout") == digest and all(
                lay.name in names and plain_size(manifest, lay.name) == kv.chunk_bytes
                for lay, kv, _, _ in wanted)

        def fill(store: Store, manifest: Manifest, buf: torch.Tensor) -> int:
            nbytes = 0
            for lay, kv, off, _ in wanted:
                part = buf[off:off + kv.chunk_bytes].numpy()
                # numpy's stubs give ndarray the buffer protocol on Python >= 3.12 only
                store.read(manifest, lay.name, into=memoryview(part))  # type: ignore[arg-type]
                nbytes += kv.chunk_bytes
            return nbytes

        def copy(buf: torch.Tensor) -> CopyHandle:
            for _, kv, _, targets in wanted:  # every id checked before any copy is issued
                kv.check(targets)
            return last([kv.restore(buf[off:off + kv.chunk_bytes], targets, skip_null=True)
                         for _, kv, off, targets in wanted])

        return ChunkRestore(chunk.key, valid, fill, copy)

    def captures(self, meta: SpoolConnectorMetadata) -> Iterator[Capture]:
        if not self._gkv:
            return
        for op in meta.group_stores:
            yield op.key, op.index, functools.partial(self._capture, op)

    def _capture(self, op: GroupChunkStore, buf: torch.Tensor) -> Captured:
        """Copy one chunk's stored blocks of every group into ``buf``; one object per
        group."""
        from .kvio import last

        targets = list(zip(self._gkv, op.blocks, strict=True))
        for (_, kv, _), ids in targets:  # every id checked before any copy is issued
            if 0 in ids:  # never read the null block (the planner does not send it)
                raise ValueError("null block in a capture")
            kv.check(ids)
        objects, handles = {}, []
        for (lay, kv, offset), ids in targets:
            part = buf[offset:offset + kv.chunk_bytes]
            handles.append(kv.capture(ids, part))
            # numpy's stubs give ndarray the buffer protocol on Python >= 3.12 only
            objects[lay.name] = memoryview(part.numpy())  # type: ignore[arg-type]
        return objects, last(handles)
