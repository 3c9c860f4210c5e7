"""A store's catalog held as a commit stuck on a hung disk holds it (decisions 2700, 2732):
``with stuck_catalog(store):`` a thread holds the catalog's lock until the block ends, then
lets go and is joined, whatever the block raised. Used by the lookup-deadline tests of one
store (tests/connector/test_vllm_parts.py), of a rank on several drives and the hung-commit tests
(tests/connector/test_vllm_drives_parts.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from spoolctl.store import Store


class _Held:
    """The held lock: ``release()`` lets go before the block ends (the commit ends while
    the test goes on); the block's end releases it too, and joins the thread."""

    def __init__(self, release: threading.Event, writer: threading.Thread) -> None:
        self._release, self._writer = release, writer

    def release(self) -> None:
        self._release.set()
        self._writer.join()


@contextlib.contextmanager
def stuck_catalog(store: Store) -> Iterator[_Held]:
    """Hold ``store``'s catalog lock on another thread (what a writer blocked in the kernel
    holds) for the duration of the block, or until the yielded handle's ``release()``; the
    lock is held when the block starts."""
    held, release = threading.Event(), threading.Event()

    def stuck_writer() -> None:
        with store.catalog.held():
            held.set()
            release.wait()

    writer = threading.Thread(target=stuck_writer, name="stuck-catalog-writer", daemon=True)
    writer.start()
    handle = _Held(release, writer)
    try:
        held.wait()
        yield handle
    finally:
        handle.release()
