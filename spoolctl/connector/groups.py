"""KV cache group semantics the connector can persist (pure; no vLLM import).

The connector learns the runtime KV cache groups from vLLM's ``KVCacheConfig``:
per group its layers, block size, optional sliding window and its *kind* as vLLM's
own public ``get_kv_cache_spec_kind`` classifies the spec (``full_attention``,
``sliding_window``, ``mamba``...). No model names and no spec class names are
consulted here.

Supported today: exactly one group of full-attention semantics (every token's KV
page is kept for the whole request, so a stored chunk's pages are exactly what a
later request needs). This includes hybrid sliding-window + full-attention models
(Gemma/Mistral style): because the connector does not claim ``SupportsHMA``, vLLM
promotes their sliding layers to full-attention pages (one group) and applies the
window in the attention kernel. Anything else (hybrid models with several groups, sliding
windows, chunked-local attention, state-space layers, MLA, unknown kinds) fails
closed at startup with one message naming the groups; with
``spoolctl_on_unsupported = "disable"`` the engine starts with the connector
disabled instead (every lookup counted as ``bypass/disabled``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spoolctl.store.errors import ConfigError

SUPPORTED_KINDS = frozenset({"full_attention"})
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

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block size must be positive")

    @property
    def unsupported_reason(self) -> str | None:
        """Why this group cannot be persisted, or None."""
        if self.kind not in SUPPORTED_KINDS:
            window = f", window {self.sliding_window}" if self.sliding_window else ""
            return f"group {self.index} is {self.kind!r}{window}"
        # A full-attention group may still carry a window: vLLM promotes the sliding layers
        # of a hybrid model to full-attention pages when the connector is not HMA-aware.
        # Its manager keeps every page, the kernel applies the window, so persisting every
        # page is exact (the window is part of the deployment identity via the spec fields).
        return None


def check_groups(groups: Sequence[GroupInfo]) -> str | None:
    """None when the connector can persist this layout, else one line saying why not."""
    if not groups:
        return "vLLM reported no KV cache groups"
    reasons = [r for r in (g.unsupported_reason for g in groups) if r is not None]
    if len(groups) > 1:
        kinds = ", ".join(f"{g.index}={g.kind}" for g in groups)
        reasons.insert(0, f"{len(groups)} KV cache groups (hybrid model: {kinds})")
    return "; ".join(reasons) if reasons else None


def unsupported_error(reason: str) -> ConfigError:
    """The one startup error for a layout the connector cannot persist."""
    return ConfigError(
        f"spoolctl connector cannot persist this model's KV cache layout: {reason}",
        path=_WHERE,
        fix='remove the spoolctl connector for this model, or set "spoolctl_on_unsupported": '
            '"disable" in kv_connector_extra_config to serve it without persistent reuse')
