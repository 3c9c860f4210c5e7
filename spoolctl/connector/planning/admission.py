"""Write admission: store a chunk only on its N-th sighting within a window (pure).

With ``spoolctl_admit_after = N`` (default 1: store on the first sighting) the scheduler
plans the store of a chunk only once N requests within ``spoolctl_admit_window`` seconds
contained it, so prompts seen once cost no disk writes.

Kept in the scheduler's memory (a restart counts afresh): per chunk sighted, 8 bytes of its
key, a count and the time of the window's first sighting, for at most ``capacity`` chunks
(least recently sighted forgotten first). A sighting counts once per request. Forgetting a
chunk only delays its admission; a truncated-key collision only admits one early.

With a daily write budget (``track=True``) sightings are counted even when ``after`` is 1,
so that ``admitted(key, after=n)`` can ask for more sightings as the budget runs low
(``deployment.write_budget.effective_after``).

Not thread-safe (vLLM's scheduler is single-threaded).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

DEFAULT_WINDOW_S = 600.0
DEFAULT_CAPACITY = 1 << 16
_KEY_BYTES = 8


class Admission:
    """Counts sightings of chunk keys; ``admitted(key)`` once seen ``after`` times within
    ``window_s`` (``after == 1``: everything is admitted and nothing is kept)."""

    def __init__(self, after: int = 1, *, window_s: float = DEFAULT_WINDOW_S,
                 capacity: int = DEFAULT_CAPACITY,
                 clock: Callable[[], float] = time.monotonic, track: bool = False):
        if after < 1:
            raise ValueError("after must be at least 1")
        if window_s <= 0 or capacity <= 0:
            raise ValueError("window and capacity must be positive")
        self.after = after
        self._track = track
        self.window_s = window_s
        self._capacity = capacity
        self._clock = clock
        # truncated key -> (sightings in the current window, when the window started)
        self._table: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        self._counted: set[str] = set()  # requests whose chunks were counted

    @property
    def enabled(self) -> bool:
        """Sightings are counted (a rule above the first sighting, or a write budget)."""
        return self.after > 1 or self._track

    def __len__(self) -> int:
        return len(self._table)

    def sighted(self, req_id: str, keys: Iterable[bytes]) -> None:
        """Request ``req_id`` contains the chunks ``keys`` (counted once per request)."""
        if not self.enabled or req_id in self._counted:
            return
        self._counted.add(req_id)
        now = self._clock()
        for key in keys:
            short = key[:_KEY_BYTES]
            count, since = self._table.pop(short, (0, now))
            if now - since > self.window_s:
                count, since = 0, now  # the earlier sightings are outside the window
            self._table[short] = (count + 1, since)
        while len(self._table) > self._capacity:
            self._table.popitem(last=False)

    def admitted(self, key: bytes, after: int | None = None) -> bool:
        """Whether chunk ``key`` was sighted often enough (``after`` times, default the
        configured rule), recently enough, to be stored."""
        after = self.after if after is None else after
        if after <= 1:
            return True
        # Counts only ever cover one window (``sighted`` restarts them), so the N-th
        # sighting was within it even if the store is planned a moment after it closed.
        entry = self._table.get(key[:_KEY_BYTES])
        return entry is not None and entry[0] >= after

    def finished(self, req_id: str) -> None:
        """The request left: a later request with the same id is a new sighting."""
        self._counted.discard(req_id)
