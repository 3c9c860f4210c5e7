"""Helpers shared by the benchmark scripts in this folder (run as ``python scripts/X.py``,
which puts this folder on ``sys.path``)."""

from __future__ import annotations

import os


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the page cache and the kernel's directory caches, so
    the next read comes from the disk. False where that is not allowed (not root, a
    container): the caller must then report its reads as possibly warm."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def equal_work_ratio(ours_s: float, ours_work: int | list[int], peer_s: float,
                     peer_work: int | list[int]) -> tuple[float | None, str | None]:
    """``ours_s / peer_s`` only where both sides did the same work (tokens restored, blocks
    stored: one count or one per repeat, paired); otherwise ``(None, why)``. A side that
    did less work is faster for it, so its time compares to nothing."""
    ours = ours_work if isinstance(ours_work, list) else [ours_work]
    peer = peer_work if isinstance(peer_work, list) else [peer_work]
    if len(ours) != len(peer):
        return None, f"{len(ours)} measured runs against {len(peer)}"
    for i, (a, b) in enumerate(zip(ours, peer, strict=True)):
        if a != b:
            side = "the peer" if b < a else "ours"
            return None, f"run {i}: ours did {a}, the peer {b} ({side} did less)"
    if peer_s <= 0:
        return None, "the peer's time is not positive"
    return round(ours_s / peer_s, 4), None
