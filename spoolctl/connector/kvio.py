"""Copying whole KV blocks between vLLM's paged KV tensors and flat chunk buffers (torch).

A chunk object is layer-major: for every layer (in sorted layer-name order) the
chunk's blocks selected along that layer's block dimension, as raw bytes. A
block is treated as opaque bytes (vLLM's CPU kernel keeps K transposed inside a
block), so nothing here depends on what a block holds; ``LayerLayout`` records
shape, dtype, strides and block dimension so a stored chunk is only restored
into an identical layout.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from spoolctl.store.digest import hash_bytes
from spoolctl.store.errors import ConfigError


@dataclass(frozen=True)
class LayerLayout:
    """How one layer's KV tensor is laid out (recorded from ``register_kv_caches``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    stride: tuple[int, ...]
    block_dim: int
    itemsize: int

    @property
    def block_bytes(self) -> int:
        n = self.itemsize
        for i, size in enumerate(self.shape):
            if i != self.block_dim:
                n *= size
        return n

    def to_json(self) -> dict:
        # num_blocks (shape[block_dim]) and strides that follow from it vary with free
        # memory at startup; a chunk only depends on the per-block shape.
        per_block = list(self.shape)
        per_block[self.block_dim] = -1
        return {"name": self.name, "block_shape": per_block, "dtype": self.dtype,
                "block_dim": self.block_dim}


def _block_dim(shape: Sequence[int], num_blocks: int | None, name: str = "") -> int:
    """The dimension indexing blocks: the first of size ``num_blocks`` (dim 0 if unknown).

    A tensor with no such dimension (e.g. a kernel-split view with ``num_blocks * ratio``
    pages) is not understood: copying "blocks" along another dimension would read or write
    the wrong bytes, so it is refused.
    """
    if num_blocks is None:
        return 0
    dims = [i for i, s in enumerate(shape) if s == num_blocks]
    if not dims:
        raise ConfigError(
            f"KV cache tensor {name or '?'} of shape {tuple(shape)} has no dimension of "
            f"{num_blocks} blocks", path="kv_caches",
            fix='this KV layout is not supported; set "spoolctl_on_unsupported": "disable" '
                "to serve without the connector")
    return dims[0]


class PagedKV:
    """The registered KV tensors of one worker and the block copies between them and chunks."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], *, num_blocks: int | None,
                 blocks_per_chunk: int):
        if not kv_caches:
            raise ConfigError("vLLM registered no KV cache tensors", fix="report this as a bug")
        self.blocks_per_chunk = blocks_per_chunk
        self.names = sorted(kv_caches)
        self.tensors = [kv_caches[n] for n in self.names]
        self.layers: list[LayerLayout] = []
        for name, t in zip(self.names, self.tensors, strict=True):
            self.layers.append(LayerLayout(
                name=name, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                stride=tuple(t.stride()), block_dim=_block_dim(t.shape, num_blocks, name),
                itemsize=t.element_size()))
        self.chunk_bytes = sum(la.block_bytes for la in self.layers) * blocks_per_chunk
        self.layout_json = {"layers": [la.to_json() for la in self.layers],
                            "blocks_per_chunk": blocks_per_chunk}
        self.layout_digest = hash_bytes(
            json.dumps(self.layout_json, sort_keys=True, separators=(",", ":")).encode())
        self.device = self.tensors[0].device

    def _views(self, buf: torch.Tensor, nblocks: int) -> list[torch.Tensor]:
        """Views of ``buf`` (uint8, CPU) as each layer's selected blocks, in chunk order."""
        views, offset = [], 0
        for la in self.layers:
            n = la.block_bytes * nblocks
            shape = list(la.shape)
            shape[la.block_dim] = nblocks
            dtype = getattr(torch, la.dtype)
            views.append(buf[offset:offset + n].view(dtype).view(shape))
            offset += n
        return views

    def capture(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy the blocks ``block_ids`` of every layer into ``out`` (uint8, chunk_bytes)."""
        if len(block_ids) != self.blocks_per_chunk or out.numel() != self.chunk_bytes:
            raise ValueError("capture needs one whole chunk")
        views = self._views(out, len(block_ids))
        for t, la, dst in zip(self.tensors, self.layers, views, strict=True):
            # Runs of consecutive block ids are copied as one slice (plain memcpy); gathers
            # (index_select) measured 10x slower inside vLLM's step on CPU.
            for j, start, n in _runs(block_ids):
                dst.narrow(la.block_dim, j, n).copy_(t.narrow(la.block_dim, start, n))

    def restore(self, src: torch.Tensor, block_ids: Sequence[int], skip: int = 0, *,
                skip_null: bool = False) -> None:
        """Copy a verified chunk buffer ``src`` into ``block_ids[skip:]`` of every layer.

        ``skip_null``: positions holding block id 0 (vLLM's null block, shared by every
        request) are left alone.
        """
        if len(block_ids) != self.blocks_per_chunk or src.numel() != self.chunk_bytes:
            raise ValueError("restore needs one whole chunk")
        views = self._views(src, len(block_ids))
        for t, la, view in zip(self.tensors, self.layers, views, strict=True):
            for j, start, n in _runs(block_ids, skip_null=skip_null):
                lo, hi = max(j, skip), j + n
                if lo >= hi:
                    continue
                t.narrow(la.block_dim, start + lo - j, hi - lo).copy_(
                    view.narrow(la.block_dim, lo, hi - lo))


def _runs(block_ids: Sequence[int], *, skip_null: bool = False) -> list[tuple[int, int, int]]:
    """Split block ids into runs of consecutive ids: ``(position, first id, length)``.

    ``skip_null``: id 0 (vLLM's null block) belongs to no run.
    """
    runs: list[tuple[int, int, int]] = []
    for pos, b in enumerate(block_ids):
        if skip_null and b == 0:
            continue
        if runs and runs[-1][0] + runs[-1][2] == pos and runs[-1][1] + runs[-1][2] == b:
            j, start, n = runs[-1]
            runs[-1] = (j, start, n + 1)
        else:
            runs.append((pos, b, 1))
    return runs


class BufferPool:
    """A fixed set of chunk-sized host buffers carved from one anonymous mapping.

    Fresh pages are expensive (a new 2 MiB buffer costs milliseconds of 4 KiB page faults on
    a VM, more than copying into it), so capture and restore recycle slots of one slab,
    advised for transparent huge pages where the kernel offers them (one fault per 2 MiB).
    Pages are only materialised when first used, so an idle pool costs address space only.
    ``get`` returns None when every slot is in use (the caller skips or waits).
    """

    def __init__(self, nbytes: int, *, slots: int):
        import contextlib
        import mmap
        import threading

        if nbytes <= 0 or slots <= 0:
            raise ValueError("a pool needs a positive buffer size and slot count")
        self.nbytes = nbytes
        self.slots = slots
        self._map = mmap.mmap(-1, nbytes * slots)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            with contextlib.suppress(OSError):  # no THP: plain pages, still recycled
                self._map.madvise(advice)
        self._slab = torch.frombuffer(self._map, dtype=torch.uint8)
        self._base = self._slab.data_ptr()
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()

    def get(self) -> torch.Tensor | None:
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        return self._slab[slot * self.nbytes:(slot + 1) * self.nbytes]

    def put(self, buf: torch.Tensor) -> None:
        offset = buf.data_ptr() - self._base
        slot, rest = divmod(offset, self.nbytes)
        if rest or not 0 <= slot < self.slots or buf.numel() != self.nbytes:
            raise ValueError("buffer does not belong to this pool")
        with self._lock:
            if slot in self._free:
                raise ValueError("buffer returned twice")
            self._free.append(slot)
