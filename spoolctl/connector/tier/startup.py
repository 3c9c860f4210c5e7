"""Opening the tier's store at engine start (no vLLM): the checks the SpoolConnector makes
before its first store, with the tier's option names.

A root the engine cannot write, on a read-only disk, or under a file, and a bound too small
for the engine's chunks, are each one ConfigError line naming the option and the fix, instead
of an OSError inside vLLM's traceback or an engine that starts and never stores a chunk.
"""

from __future__ import annotations

import logging

from spoolctl.connector.deployment.preflight import check_root
from spoolctl.errors import ConfigError
from spoolctl.store import Store

from .settings import TierSettings, check_room

log = logging.getLogger("spoolctl.connector")


def open_store(settings: TierSettings, chunk_bytes: int) -> Store:
    """The tier's store, created if absent, bounded by ``settings.max_size`` (or by its own
    recorded bound), refused when it cannot hold ``chunk_bytes``-byte chunks."""
    for line in check_root(settings.root, option="SpoolTier option 'root'"):
        log.warning("spoolctl tier: %s", line)
    check_room(settings.max_size, chunk_bytes)
    try:
        store = Store.open(settings.root, create=True, max_bytes=settings.max_size)
    except ConfigError as exc:  # e.g. a SpoolConnector's root: rank stores, no marker
        raise ConfigError(f"SpoolTier option 'root': {exc.message}", path=exc.path,
                          fix='set "root" to a new or empty directory, or to a store '
                              "`spoolctl init` made") from None
    except OSError as exc:
        raise ConfigError(f"SpoolTier cannot open its store ({exc.strerror or exc})",
                          path=settings.root,
                          fix='set "root" to a directory on a writable local disk') from None
    try:
        check_room(store.max_bytes, chunk_bytes, recorded=settings.max_size is None)
    except ConfigError:
        store.close()
        raise
    return store
