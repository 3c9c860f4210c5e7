"""The tier's counters: what it looked up, promoted, stored and refused (thread-safe)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class TierCounters:
    """Chunk counts since the tier started; ``add`` from any thread."""

    lookup_hits: int = 0
    lookup_misses: int = 0
    load_chunks: int = 0  # promoted, verified
    load_misses: int = 0  # gone since the lookup (evicted, cleaned)
    load_failures: int = 0  # corrupt (quarantined) or unreadable: recomputed
    store_chunks: int = 0
    store_failures: int = 0  # refused by the store (full disk, capacity)
    stores_dropped: int = 0  # refused at once: the store queue was full
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}
