"""Where every KV block lives: vLLM's declared KV cache layout, proven against the tensors.

Pure (no torch, no vLLM import): vLLM's config objects are read by attribute only, and
tensors are described by their shape, strides and storage offset.

vLLM (0.32 and 0.33) declares the KV cache of every layer in three parts, and allocates
it accordingly (``vllm.v1.kv_cache_interface.create_kv_cache_views``):

* the **logical shape** ``[L, B, H, N, C]`` (layers, blocks, head slots, states per
  block, content bytes per state), with ``H``, ``N``, ``C`` and the dtype taken from the
  group's ``KVCacheSpec`` (``num_heads``, ``num_states``, ``state_content_size_bytes``,
  ``dtype``, ``page_size_padded``). This covers plain attention (``C`` = K and V of one
  head), MLA latent caches (``H = 1``, ``C`` = latent + rope), packed/quantised caches
  (``num_head_slots``, ``state_content_bytes``) and compressed caches
  (``tokens_per_state > 1``: fewer states than tokens);
* the **layout** ``KVCacheLayout`` resolved for the model (``KVCacheConfig.kv_cache_layout``):
  a permutation of ``LBHNC`` naming the memory order (e.g. ``LBNHC``, or ``BLHNC`` with
  layers interleaved per block);
* the **placement** of each ``KVCacheTensor`` (``offset``, ``layer_stride``,
  ``block_stride``) inside one shared backing buffer.

Each layer reaches the connector as a ``[B', H, N', C/itemsize]`` view where a manager
block may be split into ``ratio = B' / num_blocks`` kernel blocks (``N' = N / ratio``).
``declared_view`` recomputes the view vLLM must have built from those declarations;
``prove`` compares it with the tensor actually registered (shape, strides, offset) and
refuses any difference, then derives ``BlockGeometry``: where manager block ``b``'s
bytes are, as a few contiguous pieces. The block dimension is never guessed from sizes.

A stored page is the block's bytes in memory order (the order of decreasing stride), so
the bytes of a chunk depend on the page's memory order, which ``BlockGeometry.to_json``
records (and nothing else about the layout: two layouts with the same page order store
the same bytes).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from spoolctl.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from ..vllm_api.protocols import (
        KVCacheConfigLike,
        KVCacheGroupLike,
        KVCacheTensorLike,
        LayerSpecLike,
    )

LOGICAL = "LBHNC"  # vLLM's logical axis order (RFC #42082)
_L, _B, _H, _N, _C = range(5)
_FIX = 'this KV layout is not supported; set "spoolctl_on_unsupported": "disable" to serve ' \
       "without the connector, or report the layout (the message names it)"


class LayoutError(ConfigError):
    """A KV cache layout the connector cannot prove; raised at startup."""

    def __init__(self, message: str):
        super().__init__(message, path="kv_caches", fix=_FIX)


def stride_order(layout: str) -> tuple[int, ...]:
    """The stride permutation of a ``KVCacheLayout`` name (``"LBNHC"`` -> ``(0, 1, 3, 2, 4)``).

    vLLM's enum values are exactly these permutations (checked against the installed vLLM
    in the tests). The content axis must be innermost: vLLM views it as the dtype.
    """
    name = str(layout).upper()
    if len(name) != 5 or sorted(name) != sorted(LOGICAL):
        raise LayoutError(f"unknown KV cache layout {layout!r} (expected a permutation of "
                          f"{LOGICAL})")
    order = tuple(LOGICAL.index(c) for c in name)
    if order[-1] != _C:
        raise LayoutError(f"KV cache layout {name} does not keep the content innermost")
    return order


@dataclass(frozen=True)
class LayerDecl:
    """What vLLM declares for one layer's KV cache (all sizes in bytes unless named)."""

    name: str
    layout: str  # KVCacheLayout name, e.g. "LBNHC"
    num_blocks: int  # manager blocks in the pool backing this layer
    heads: int  # H
    states: int  # N per manager block
    content_bytes: int  # C
    itemsize: int
    dtype: str
    layer_index: int  # position in its KVCacheTensor's layers (L)
    num_layers: int
    offset: int  # byte offset of layers[0]'s block 0 in the backing buffer
    layer_stride: int
    block_stride: int
    padded_page: int | None = None

    def __post_init__(self) -> None:
        stride_order(self.layout)
        for field in ("num_blocks", "heads", "states", "content_bytes", "itemsize",
                      "num_layers", "block_stride"):
            if getattr(self, field) <= 0:
                raise LayoutError(f"KV cache of {self.name}: declared {field} "
                                  f"{getattr(self, field)} is not positive")
        if not 0 <= self.layer_index < self.num_layers:
            raise LayoutError(f"KV cache of {self.name}: layer {self.layer_index} outside its "
                              f"tensor's {self.num_layers} layers")
        if self.content_bytes % self.itemsize:
            raise LayoutError(f"KV cache of {self.name}: {self.content_bytes} content bytes "
                              f"are not whole {self.dtype} elements")

    @property
    def page_bytes(self) -> int:
        """Bytes of one manager block of this layer (without padding)."""
        return self.heads * self.states * self.content_bytes


@dataclass(frozen=True)
class TensorView:
    """A registered tensor's geometry (elements; ``offset`` in elements from storage start)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    itemsize: int
    dtype: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorView:
        """Read a torch tensor's geometry (no torch import at runtime)."""
        return cls(tuple(int(s) for s in tensor.shape), tuple(int(s) for s in tensor.stride()),
                   int(tensor.storage_offset()), int(tensor.element_size()),
                   str(tensor.dtype).removeprefix("torch."))


def declared_view(decl: LayerDecl, ratio: int = 1) -> TensorView:
    """The ``[B', H, N', C/itemsize]`` view vLLM builds for ``decl`` with ``ratio`` kernel
    blocks per manager block (mirrors ``compute_layout_strides`` / ``create_kv_cache_views``)."""
    order = stride_order(decl.layout)
    if ratio < 1 or decl.states % ratio:
        raise LayoutError(f"KV cache of {decl.name}: {decl.states} states per block cannot "
                          f"be split into {ratio} kernel blocks")
    block_stride = decl.block_stride
    padded = decl.padded_page
    if ratio > 1:
        if padded is not None or block_stride % ratio:
            raise LayoutError(f"KV cache of {decl.name}: padded or packed blocks split into "
                              f"{ratio} kernel blocks")
        block_stride //= ratio
    shape = (decl.num_layers, decl.num_blocks * ratio, decl.heads, decl.states // ratio,
             decl.content_bytes)
    strides = _strides(shape, order, (decl.layer_stride, block_stride), padded)
    byte_offset = decl.offset + decl.layer_index * strides[_L]
    size = decl.itemsize
    if byte_offset % size or any(s % size for s in strides[1:4]):
        raise LayoutError(f"KV cache of {decl.name}: declared strides are not whole "
                          f"{decl.dtype} elements")
    return TensorView(shape=(shape[_B], shape[_H], shape[_N], decl.content_bytes // size),
                      stride=(strides[_B] // size, strides[_H] // size, strides[_N] // size, 1),
                      offset=byte_offset // size, itemsize=size, dtype=decl.dtype)


def _strides(shape: Sequence[int], order: Sequence[int], fixed: tuple[int | None, int | None],
             padded: int | None) -> list[int]:
    """Byte strides of the logical ``[L, B, H, N, C]`` axes (``compute_layout_strides``):
    dense in memory order from the innermost axis out, with L and B strides fixed where
    given and a padded page rounding the stride of the axis that closes the page."""
    page_grid_end = max(order.index(_L), order.index(_B)) + 1
    strides = [0] * 5
    current = 1
    for physical, dim in reversed(tuple(enumerate(order))):
        if padded is not None and physical == page_grid_end - 1:
            current = max(current, padded)
        given = fixed[dim] if dim in (_L, _B) else None
        strides[dim] = given or current
        current = strides[dim] * shape[dim]
    return strides


def place(names: Sequence[str], *, layout: str, num_blocks: int, heads: int, states: int,
          content_bytes: int, itemsize: int, dtype: str, padded_page: int | None = None
          ) -> tuple[int, dict[str, LayerDecl]]:
    """Where vLLM places one KV cache group of same-shaped layers in a fresh buffer
    (``get_kv_cache_config_from_groups`` for one group): ``(buffer bytes, declarations)``.

    For building vLLM-shaped KV caches without vLLM (``scripts/gpu_check.py``, tests); the
    tests check it against vLLM's own placement for every layout.
    """
    order = stride_order(layout)
    page = padded_page if padded_page is not None else heads * states * content_bytes
    # Block-outermost layouts interleave the layers' pages per block; a layer-outer
    # layout fixes the block stride only to pad a page.
    fixed_block = page * len(names) if order[0] == _B else padded_page
    shape = (len(names), num_blocks, heads, states, content_bytes)
    strides = _strides(shape, order, (None, fixed_block), padded_page)
    decls = {name: LayerDecl(name=name, layout=layout, num_blocks=num_blocks, heads=heads,
                             states=states, content_bytes=content_bytes, itemsize=itemsize,
                             dtype=dtype, layer_index=i, num_layers=len(names), offset=0,
                             layer_stride=strides[_L], block_stride=strides[_B],
                             padded_page=padded_page)
             for i, name in enumerate(names)}
    return page * len(names) * num_blocks, decls


@dataclass(frozen=True)
class BlockGeometry:
    """Where the bytes of manager block ``b`` of one layer are, relative to its storage.

    Block ``b`` starts at byte ``base + b * block_stride``; its page is ``len(pieces)``
    contiguous runs of ``piece_bytes`` at the offsets ``pieces`` (in memory order), which
    make ``page_bytes`` in total. ``block_shape`` / ``page_order`` describe the stored page.
    """

    name: str
    dtype: str
    itemsize: int
    base: int
    block_stride: int
    num_blocks: int
    pieces: tuple[int, ...]
    piece_bytes: int
    block_shape: tuple[int, ...]  # logical page dims (after the block), elements
    page_order: str  # the page dims in memory order, e.g. "HNC" (R: kernel blocks)

    @property
    def page_bytes(self) -> int:
        return len(self.pieces) * self.piece_bytes

    @property
    def dense(self) -> bool:
        """Consecutive blocks are one contiguous run (copied as one piece)."""
        return len(self.pieces) == 1 and self.block_stride == self.piece_bytes

    def to_json(self) -> dict:
        # The keys of the original format (one [num_blocks, H, N, C] layer, block dim 0);
        # "page_order" only when the page's memory order is not the listed one, so stored
        # chunks of the layouts that had no such key keep their layout digest.
        doc: dict[str, Any] = {"name": self.name, "block_shape": [-1, *self.block_shape],
                               "dtype": self.dtype, "block_dim": 0}
        if self.page_order != "RHNC"[4 - len(self.block_shape):]:
            doc["page_order"] = self.page_order
        return doc


def geometry(name: str, view: TensorView, num_blocks: int) -> BlockGeometry:
    """Block geometry of a ``[B', H, N', C]`` view with ``B' = ratio * num_blocks``.

    Proves that distinct (block, page element) pairs never share a byte, so a block copy
    touches nothing but that block.
    """
    if len(view.shape) != 4:
        raise LayoutError(f"KV cache of {name}: {len(view.shape)}-dimensional view "
                          f"{view.shape} (vLLM registers [blocks, heads, states, content])")
    if num_blocks <= 0 or not view.shape[0] or view.shape[0] % num_blocks:
        raise LayoutError(f"KV cache of {name}: {view.shape[0]} pages are not a whole number "
                          f"of kernel blocks for each of {num_blocks} blocks")
    if view.stride[3] != 1:
        raise LayoutError(f"KV cache of {name}: content is not innermost (strides "
                          f"{view.stride})")
    ratio = view.shape[0] // num_blocks
    size = view.itemsize
    # The page's dims as (name, size, byte stride); the content is counted in bytes.
    dims = [("H", view.shape[1], view.stride[1] * size),
            ("N", view.shape[2], view.stride[2] * size),
            ("C", view.shape[3] * size, 1)]
    if ratio > 1:  # a manager block is `ratio` kernel blocks
        dims.insert(0, ("R", ratio, view.stride[0] * size))
    block_stride = view.stride[0] * size * ratio
    # No two elements share a byte: adjacent dims in memory order (block dim included)
    # must not interleave. Size-1 dims address nothing.
    live = sorted((d for d in [("B", num_blocks, block_stride), *dims] if d[1] > 1),
                  key=lambda d: -d[2])
    if live and live[-1][2] <= 0:
        raise LayoutError(f"KV cache of {name}: dim {live[-1][0]} repeats its bytes "
                          f"(strides {view.stride})")
    for (oname, _, ostride), (iname, isize, istride) in itertools.pairwise(live):
        if ostride < isize * istride:
            raise LayoutError(f"KV cache of {name}: dims {oname} and {iname} overlap "
                              f"(shape {view.shape}, strides {view.stride})")
    in_memory = sorted((d for d in dims if d[1] > 1), key=lambda d: -d[2])
    # The innermost dims that are dense make one contiguous piece; the others repeat it.
    piece = 1
    outer: list[tuple[int, int]] = []
    for _, dsize, dstride in reversed(in_memory):
        if not outer and dstride == piece:
            piece *= dsize
        else:
            outer.append((dsize, dstride))
    outer.reverse()
    pieces = tuple(sum(i * s for i, (_, s) in zip(idx, outer, strict=True))
                   for idx in itertools.product(*(range(n) for n, _ in outer)))
    # Size-1 dims keep their listed place in the order: they do not change the bytes.
    moving = iter(d[0] for d in in_memory)
    page_order = "".join(next(moving) if n > 1 else d for d, n, _ in dims)
    return BlockGeometry(
        name=name, dtype=view.dtype, itemsize=size, base=view.offset * size,
        block_stride=block_stride, num_blocks=num_blocks, pieces=pieces, piece_bytes=piece,
        block_shape=(*(d[1] for d in dims[:-1]), view.shape[3]), page_order=page_order)


def prove(decl: LayerDecl, tensor: TensorView) -> BlockGeometry:
    """The geometry of ``tensor`` if it is exactly the view vLLM declares for ``decl``;
    ``LayoutError`` naming the first difference otherwise."""
    if tensor.itemsize != decl.itemsize or tensor.dtype != decl.dtype:
        raise LayoutError(f"KV cache of {decl.name}: registered as {tensor.dtype}, declared "
                          f"{decl.dtype}")
    if len(tensor.shape) != 4 or not tensor.shape[0] or tensor.shape[0] % decl.num_blocks:
        raise LayoutError(f"KV cache of {decl.name}: registered shape {tensor.shape} is not "
                          f"[{decl.num_blocks} blocks (or kernel blocks), {decl.heads}, "
                          f"{decl.states}, {decl.content_bytes // decl.itemsize}] "
                          f"({decl.layout})")
    want = declared_view(decl, tensor.shape[0] // decl.num_blocks)
    if tensor.shape != want.shape:
        raise LayoutError(f"KV cache of {decl.name}: registered shape {tensor.shape}, "
                          f"declared {want.shape} ({decl.layout})")
    for dim, (got, exp, n) in enumerate(zip(tensor.stride, want.stride, want.shape,
                                            strict=True)):
        if n > 1 and got != exp:
            raise LayoutError(f"KV cache of {decl.name}: registered strides {tensor.stride}, "
                              f"declared {want.stride} (dim {dim}, layout {decl.layout})")
    if tensor.offset != want.offset:
        raise LayoutError(f"KV cache of {decl.name}: registered at element {tensor.offset} "
                          f"of its buffer, declared {want.offset} ({decl.layout})")
    return geometry(decl.name, tensor, decl.num_blocks)


# -- reading vLLM's declarations (attribute access only) --------------------------------------

def _layer_specs(group: KVCacheGroupLike) -> Mapping[str, object]:
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    if isinstance(per_layer, Mapping):
        return per_layer
    return {name: spec for name in group.layer_names}


def declarations(kv_cache_config: KVCacheConfigLike, layout: str,
                 layers: Iterable[str] | None = None) -> dict[str, LayerDecl]:
    """Every layer's ``LayerDecl`` from vLLM's runtime ``KVCacheConfig`` and the resolved
    ``layout`` name; ``layers`` restricts it. A layer vLLM declares without a per-layer view
    (state-space raw buffers) or whose spec lacks a field is refused."""
    wanted = None if layers is None else set(layers)
    specs: dict[str, object] = {}
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        specs.update(_layer_specs(group))
    tensors = getattr(kv_cache_config, "kv_cache_tensors", None)
    if tensors is None:
        raise LayoutError("this vLLM's KVCacheConfig declares no kv_cache_tensors")
    out: dict[str, LayerDecl] = {}
    for kt in tensors:
        names = list(kt.layers)
        num_blocks_of = getattr(kv_cache_config, "num_blocks_of", None)
        num_blocks = int(num_blocks_of(kt) if callable(num_blocks_of)
                         else kv_cache_config.num_blocks)
        for index, name in enumerate(names):
            if wanted is not None and name not in wanted:
                continue
            spec = specs.get(name)
            if spec is None:
                raise LayoutError(f"KV cache of {name}: in no KV cache group")
            out[name] = _decl(name, spec, layout, kt, index, len(names), num_blocks)
    return out


def _decl(name: str, spec: object, layout: str, kt: KVCacheTensorLike, index: int,
          num_layers: int, num_blocks: int) -> LayerDecl:
    if not getattr(spec, "has_layer_views", True):
        raise LayoutError(f"KV cache of {name}: {type(spec).__name__} has no per-layer "
                          "block view")
    page = cast("LayerSpecLike", spec)  # a spec lacking these fields is refused below
    try:
        dtype = page.dtype
        itemsize = int(getattr(dtype, "itemsize", 0)) or int(dtype.element_size())
        heads, states = int(page.num_heads), int(page.num_states)
        content = int(page.state_content_size_bytes)
        padded = getattr(spec, "page_size_padded", None)
        return LayerDecl(
            name=name, layout=str(layout), num_blocks=num_blocks, heads=heads,
            states=states, content_bytes=content, itemsize=itemsize,
            dtype=str(dtype).removeprefix("torch."), layer_index=index,
            num_layers=num_layers, offset=int(getattr(kt, "offset", 0)),
            layer_stride=int(kt.layer_stride), block_stride=int(kt.block_stride),
            padded_page=None if padded is None else int(padded))
    except (AttributeError, NotImplementedError, TypeError, ValueError) as exc:
        raise LayoutError(f"KV cache of {name}: {type(spec).__name__} does not declare its "
                          f"page ({exc})") from None
