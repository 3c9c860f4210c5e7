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
