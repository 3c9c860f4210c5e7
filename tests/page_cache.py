"""The page cache's own view of a file, for tests of early write-back (decisions 2830, 2951):
how many of its pages are still dirty, and whether this filesystem shows it at all."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def dirty_pages(fd: int, size: int) -> int | None:
    """Pages of ``fd``'s first ``size`` bytes still dirty in the page cache (Linux 6.5+
    ``cachestat``, syscall 451 on every architecture); None where it does not exist."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    span = (ctypes.c_uint64 * 2)(0, size)
    stat = (ctypes.c_uint64 * 5)()  # cache, dirty, writeback, evicted, recently evicted
    if libc.syscall(451, ctypes.c_long(fd), span, stat, ctypes.c_long(0)) != 0:
        return None
    return int(stat[1])


def skip_without_dirty_accounting(tmp_dir: Path, size: int) -> None:
    """Skip unless a plain write of ``size`` bytes in ``tmp_dir`` is seen dirty until its
    fsync and clean after it (no cachestat, or tmpfs, whose pages stay dirty)."""
    from spoolctl.store.disk.fsio import create_tmp

    pages = size // os.sysconf("SC_PAGE_SIZE")
    control = create_tmp(tmp_dir)
    try:
        os.write(control.fd, os.urandom(size))
        dirty = dirty_pages(control.fd, size)
        if dirty is None or dirty < pages // 2:
            pytest.skip("no cachestat here, or a filesystem without dirty page accounting")
        os.fsync(control.fd)
        if (dirty_pages(control.fd, size) or 0) > pages // 4:
            pytest.skip("a filesystem whose pages stay dirty after fsync (tmpfs)")
    finally:
        control.discard()
