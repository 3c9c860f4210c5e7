"""The store's size bound (DESIGN.md, "Bounded"): maintenance evicts down to the low
watermark, and an entry larger than it can never be stored (it would be evicted at once).

One rule shared by the commit path (an entry's budget), maintenance (the eviction target)
and import (the room a store may still take), so that none imports it from another.
"""

from __future__ import annotations

# Eviction goes down to this share of the max size, so a store at its bound is not
# evicted again at every commit.
LOW_WATERMARK = 0.9


def low_watermark(max_bytes: int) -> int:
    """Bytes a store of max size ``max_bytes`` is evicted down to (and the most one entry
    may hold)."""
    return int(max_bytes * LOW_WATERMARK)
