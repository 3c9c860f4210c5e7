"""Opening the store of a local controller: the default size limit of a store it creates,
and one owner of that limit.

A store a controller creates without ``max_bytes`` is bounded: a tenth of its filesystem,
at most 64 GiB, at least 1 GiB where the filesystem has 2. An existing store keeps its own
limit; a different ``max_bytes`` is a ConfigError, never a silent rewrite.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

from spoolctl.store import MARKER as ROOT_MARKER
from spoolctl.store import ConfigError, Store

DEFAULT_MAX_FRACTION = 10
DEFAULT_MAX_CAP = 64 << 30
DEFAULT_MAX_FLOOR = 1 << 30


def default_max_bytes(path: str | os.PathLike[str]) -> int:
    """The size limit of a store created at ``path`` without one: a tenth of the size of
    the filesystem that holds it, at most ``DEFAULT_MAX_CAP``, at least
    ``DEFAULT_MAX_FLOOR`` (or half the filesystem, if smaller)."""
    probe = Path(os.path.abspath(os.fspath(path)))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
        total = st.f_blocks * st.f_frsize
    except OSError:
        return DEFAULT_MAX_CAP
    floor = min(DEFAULT_MAX_FLOOR, total // 2)
    return max(1, min(DEFAULT_MAX_CAP, max(total // DEFAULT_MAX_FRACTION, floor)))


def open_store(root: str | os.PathLike[str], *, max_bytes: int | None,
                read_only: bool) -> Store:
    """Open (create) the store at ``root``; ``read_only``: open an existing store for
    reading, through the store's read-only mode where this store library has one.

    One owner of the size limit: a new store gets ``max_bytes`` (default
    ``default_max_bytes``); an existing store keeps its own, and a different
    ``max_bytes`` is refused rather than rewritten for every worker sharing the store."""
    if not read_only:
        path = os.fspath(root)
        if not os.path.lexists(os.path.join(path, ROOT_MARKER)):
            limit = max_bytes if max_bytes is not None else default_max_bytes(path)
            return Store.open(path, create=True, max_bytes=limit)
        store = Store.open(path, create=True)
        if max_bytes is not None and max_bytes != store.max_bytes:
            have = store.max_bytes
            store.close()
            raise ConfigError(
                f"this store's size limit is {have if have is not None else 'unbounded'}"
                f" bytes, not max_bytes={max_bytes}: the limit belongs to the store, not to "
                "one of the workers sharing it", path=path,
                fix=f"leave max_bytes out, or change the limit for every worker with "
                    f"`spoolctl init --root {path} --max-size {max_bytes}`")
        return store
    if "read_only" in inspect.signature(Store.open).parameters:
        return Store.open(os.fspath(root), read_only=True)
    return Store.open(os.fspath(root))
