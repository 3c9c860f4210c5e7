"""A store's catalog held as a commit stuck on a hung disk holds it (decisions 2700, 2732):
``with stuck_catalog(store):`` a thread holds the catalog's lock until the block ends, then
lets go and is joined, whatever the block raised. Used by the lookup-deadline tests of one
store (tests/test_vllm_parts.py) and of a rank on several drives
(tests/test_vllm_drives_parts.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from spoolctl.store import Store


@contextlib.contextmanager
def stuck_catalog(store: Store) -> Iterator[None]:
    """Hold ``store``'s catalog lock on another thread (what a writer blocked in the kernel
    holds) for the duration of the block; the lock is held when the block starts."""
    held, release = threading.Event(), threading.Event()

    def stuck_writer() -> None:
        with store.catalog._lock:
            held.set()
            release.wait()

    writer = threading.Thread(target=stuck_writer, name="stuck-catalog-writer")
    writer.start()
    try:
        held.wait()
        yield
    finally:
        release.set()
        writer.join()
