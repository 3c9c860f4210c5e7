"""Progress a long read of the store reports while it runs, so that whoever waits on it with a
deadline can tell a large directory from a disk that does not answer."""

from __future__ import annotations

import time
from collections.abc import Callable

_sink: Callable[[], None] | None = None
_last = 0.0
_EVERY_S = 0.1  # at most this often: a tick is a write to a pipe


def install_progress_sink(sink: Callable[[], None] | None) -> None:
    """Call ``sink()`` as reads make progress (None: nobody listens)."""
    global _sink
    _sink = sink


def tick() -> None:
    """Some of a long read is done (call it every few hundred entries)."""
    global _last
    if _sink is None:
        return
    now = time.monotonic()
    if now - _last >= _EVERY_S:
        _last = now
        _sink()
