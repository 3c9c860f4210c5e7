"""KV cache group semantics the connector can persist (pure; no vLLM import).

The connector learns the runtime KV cache groups from vLLM's ``KVCacheConfig``:
per group its layers, block size, optional sliding window (and the extra tokens
vLLM retains behind it) and its *kind* as vLLM's own public
``get_kv_cache_spec_kind`` classifies the spec (``full_attention``,
``sliding_window``, ``mamba``...). No model names and no spec class names are
consulted here.

Two layouts are persisted:

* **single**: exactly one group of full-attention semantics (every token's KV page is
  kept for the whole request). This includes hybrid sliding-window models served with
  vLLM's hybrid allocator off (``--disable-hybrid-kv-cache-manager``): vLLM promotes their
  sliding layers to full pages and applies the window in the kernel. Restores are
  synchronous; a chunk is one object ``kv``.
* **grouped** (``SupportsHMA``): any number of groups, each ``full_attention`` or
  ``sliding_window``. A chunk entry holds one object per group (``g0``, ``g1``...): a
  full group stores the chunk's ``k = C / bs`` blocks, a sliding group only the chunk's
  last ``t = min(k, cdiv(W + x, bs))`` blocks (``W`` window, ``x`` extra retained
  tokens): the pages vLLM keeps for a request whose computed prefix ends at the chunk
  boundary (or one token before it). Restores are asynchronous (``failed_recving``).

Anything else (state-space layers, chunked-local attention, MLA, draft-model or
non-transferable groups, unknown kinds, block sizes the chunk size is not a multiple
of) fails closed at startup with one message naming the groups; with
``spoolctl_on_unsupported = "disable"`` the engine starts with the connector
disabled instead (every lookup counted as ``bypass/disabled``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from spoolctl.errors import ConfigError

FULL = "full_attention"
SLIDING = "sliding_window"
SUPPORTED_KINDS = frozenset({FULL, SLIDING})
_WHERE = "kv_cache_config"


@dataclass(frozen=True)
class GroupInfo:
    """What the connector needs to know about one KV cache group."""

    index: int
    kind: str
    layers: tuple[str, ...]
    block_size: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    extra_retained_tokens: int = 0
    # Why vLLM's group flags forbid persisting it (draft-model group, not transferable...).
    flag: str | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block size must be positive")

    @property
    def unsupported_reason(self) -> str | None:
        """Why this group cannot be persisted, or None."""
        window = f", window {self.sliding_window}" if self.sliding_window else ""
        if self.kind not in SUPPORTED_KINDS:
            return f"group {self.index} is {self.kind!r}{window}"
        if self.flag is not None:
            return f"group {self.index} ({self.kind}) is {self.flag}"
        if self.kind == SLIDING and (not isinstance(self.sliding_window, int)
                                     or self.sliding_window <= 0):
            return f"group {self.index} is 'sliding_window' without a usable window size"
        if self.extra_retained_tokens < 0:
            return f"group {self.index} retains a negative number of extra tokens"
        # A full-attention group may still carry a window: vLLM promotes the sliding layers
        # of a hybrid model to full-attention pages when its hybrid allocator is off. Its
        # manager keeps every page, the kernel applies the window, so persisting every
        # page is exact (the window is part of the deployment identity via the spec fields).
        return None


def is_single(groups: Sequence[GroupInfo]) -> bool:
    """One full-attention group: the original single-object, synchronous format."""
    return len(groups) == 1 and groups[0].kind == FULL and groups[0].flag is None


def check_groups(groups: Sequence[GroupInfo], chunk_tokens: int | None = None) -> str | None:
    """None when the connector can persist this layout, else one line saying why not."""
    if not groups:
        return "vLLM reported no KV cache groups"
    reasons = [r for r in (g.unsupported_reason for g in groups) if r is not None]
    if chunk_tokens is not None:
        lcm = math.lcm(*(g.block_size for g in groups))
        if chunk_tokens % lcm:
            reasons.append(f"spoolctl_chunk_tokens {chunk_tokens} is not a multiple of every "
                           f"group's block size (their LCM is {lcm})")
    if reasons and len(groups) > 1:
        kinds = ", ".join(f"{g.index}={g.kind}" for g in groups)
        reasons.insert(0, f"{len(groups)} KV cache groups ({kinds})")
    return "; ".join(reasons) if reasons else None


@dataclass(frozen=True)
class GroupLayout:
    """How one group is stored in a chunk entry (grouped format)."""

    index: int
    block_size: int
    blocks_per_chunk: int  # k = C / bs
    stored_blocks: int  # t: the chunk's last t blocks are stored (k for full groups)
    window: int | None = None  # sliding window in tokens (None: full attention)
    extra: int = 0  # tokens vLLM retains behind the window

    @property
    def name(self) -> str:
        return f"g{self.index}"

    @property
    def sliding(self) -> bool:
        return self.window is not None

    @property
    def first_stored(self) -> int:
        """Offset, inside a chunk, of the first stored block."""
        return self.blocks_per_chunk - self.stored_blocks

    def to_json(self) -> dict:
        return {"object": self.name, "block_size": self.block_size,
                "blocks_per_chunk": self.blocks_per_chunk,
                "stored_blocks": self.stored_blocks, "window": self.window,
                "extra_retained_tokens": self.extra}


def group_layouts(groups: Sequence[GroupInfo], chunk_tokens: int) -> list[GroupLayout]:
    """The grouped format for ``groups`` (call only when ``check_groups`` passed)."""
    out = []
    for g in groups:
        k = chunk_tokens // g.block_size
        if g.kind == SLIDING:
            assert g.sliding_window is not None
            need = -(-(g.sliding_window + g.extra_retained_tokens) // g.block_size)
            out.append(GroupLayout(g.index, g.block_size, k, min(k, need),
                                   g.sliding_window, g.extra_retained_tokens))
        else:
            out.append(GroupLayout(g.index, g.block_size, k, k))
    return out


def choose_layouts(groups: Sequence[GroupInfo], chunk_tokens: int, *,
                   decode_context_parallel: int = 1,
                   pipeline_parallel: int = 1) -> tuple[list[GroupLayout], str | None]:
    """The stored format for ``groups``: ``(layouts, None)`` for the grouped format,
    ``([], None)`` for the single format, ``([], reason)`` for a layout the connector
    cannot persist (one line, see ``check_groups``)."""
    grouped = not is_single(groups)
    unsupported = check_groups(groups, chunk_tokens if grouped else None)
    if unsupported is None and grouped and decode_context_parallel > 1:
        unsupported = f"decode context parallelism ({decode_context_parallel}) with " \
                      f"{len(groups)} KV cache group(s)"
    if unsupported is None and grouped and pipeline_parallel > 1:
        # Each stage sees only its own layers' groups, the scheduler stage 0's: the
        # per-group format would differ between stages.
        unsupported = f"pipeline parallelism ({pipeline_parallel}) with {len(groups)} KV " \
                      "cache group(s)"
    if unsupported is not None or not grouped:
        return [], unsupported
    return group_layouts(groups, chunk_tokens), None


def unsupported_error(reason: str) -> ConfigError:
    """The one startup error for a layout the connector cannot persist."""
    return ConfigError(
        f"spoolctl connector cannot persist this model's KV cache layout: {reason}",
        path=_WHERE,
        fix='remove the spoolctl connector for this model, or set "spoolctl_on_unsupported": '
            '"disable" in kv_connector_extra_config to serve it without persistent reuse')
