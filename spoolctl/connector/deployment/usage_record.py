"""How well a deployment's cache serves, said in the deployment directory: ``usage.json``.

The hit rate is counted by the engine's scheduler (``spoolctl_hit_tokens_total`` /
``spoolctl_lookup_tokens_total`` on vLLM's /metrics), which an operator running
``spoolctl status`` on the host may not scrape. The scheduler also writes its cumulative
counts since the engine started next to the rank stores, at most every ``interval`` seconds
(5) and only when they changed, and once more at the engine's exit, so ``status`` can show
the hit rate of the running (or last) engine without Prometheus. Like ``deployment.json`` it
is for people only: nothing decides from it. The write runs on a daemon thread, one at a time
(a slow disk skips updates, it never delays a scheduler step), atomically, never through a
symlink; read bounded, without following links (``description.read_record``). A process
that ends without running exit handlers (kill -9, ``os._exit``) leaves the counts of its last
write, at most ``interval`` old: ``status`` shows when they were updated. With several
engines on one deployment the file is the last writer's counts: ``status`` says which engine
start they count from.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spoolctl.store import write_tmp

from .description import read_record

log = logging.getLogger("spoolctl.connector")

FILENAME = "usage.json"
SCHEMA = "spoolctl-usage/v1"
_FIELDS: dict[str, tuple[type, ...]] = {
    "since": (int, float), "updated": (int, float), "lookup_tokens": (int,),
    "hit_tokens": (int,), "lookups": (int,), "hits": (int,),
}
DEFAULT_INTERVAL_S = 5.0


@dataclass(frozen=True)
class Usage:
    """Counts since ``since`` (the engine's start, Unix time), as of ``updated``."""

    since: float
    updated: float
    lookup_tokens: int
    hit_tokens: int
    lookups: int
    hits: int

    def __post_init__(self) -> None:
        if min(self.lookup_tokens, self.hit_tokens, self.lookups, self.hits) < 0 or \
                self.hit_tokens > self.lookup_tokens or self.hits > self.lookups:
            raise ValueError(f"inconsistent usage counts: {self}")

    @property
    def hit_rate(self) -> float | None:
        """Prompt tokens restored / prompt tokens looked up; None before the first lookup."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else None

    def to_json(self) -> dict[str, Any]:
        return {"since": self.since, "updated": self.updated,
                "lookup_tokens": self.lookup_tokens, "hit_tokens": self.hit_tokens,
                "lookups": self.lookups, "hits": self.hits, "hit_rate": self.hit_rate}


def read(deployment_dir: Path) -> Usage | None:
    """The last written counts, None when there are none; ``DescriptionError`` when the file
    is unreadable or malformed (or inconsistent)."""
    from .description import DescriptionError

    fix = "the engine rewrites it within a minute of its next request (or delete it)"
    doc = read_record(deployment_dir / FILENAME, SCHEMA, _FIELDS, "a usage record", fix)
    if doc is None:
        return None
    try:
        return Usage(**doc)
    except ValueError:
        raise DescriptionError(f"{deployment_dir / FILENAME} is not a usage record; "
                               f"{fix}") from None


class UsageRecorder:
    """Writes ``usage.json`` for one engine (its scheduler). ``offer`` is cheap and called
    every scheduler step; it starts a background write when ``interval`` passed since the
    last one and the counts changed. ``close`` writes the final counts (bounded wait)."""

    def __init__(self, deployment_dir: Path, *, interval: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.time) -> None:
        self._dir = deployment_dir
        self._interval = interval
        self._clock = clock
        self._since = clock()
        self._last_try = float("-inf")
        self._written: tuple[int, ...] | None = None
        self._busy = threading.Lock()

    def offer(self, counts: Callable[[], tuple[int, int, int, int]]) -> bool:
        """If ``interval`` passed since the last write, ``counts()`` (lookup tokens, hit
        tokens, lookups, hits) is written soon when it changed; True if a write started."""
        now = self._clock()
        if now - self._last_try < self._interval:
            return False
        values = tuple(int(v) for v in counts())
        if values == self._written:
            return False
        if not self._busy.acquire(blocking=False):  # the last write is still on the disk
            return False
        self._last_try = now
        threading.Thread(target=self._write_then_release, args=(values, now), daemon=True,
                         name="spoolctl-usage").start()
        return True

    def close(self, counts: Callable[[], tuple[int, int, int, int]],
              timeout: float = 2.0) -> None:
        """The final counts at engine shutdown (skipped if a write is stuck)."""
        values = tuple(int(v) for v in counts())
        if values == self._written or not self._busy.acquire(timeout=timeout):
            return
        self._write_then_release(values, self._clock())

    def _write_then_release(self, counts: tuple[int, ...], now: float) -> None:
        try:
            usage = Usage(self._since, now, *counts)
            if not stat.S_ISDIR(os.lstat(self._dir).st_mode):
                return  # no rank store yet (or the directory was replaced): nothing to say
            doc = {"schema": SCHEMA, **{k: v for k, v in usage.to_json().items()
                                        if k in _FIELDS}}
            tmp, _, _ = write_tmp(self._dir, [json.dumps(doc, sort_keys=True).encode() + b"\n"])
            # No directory fsync: a lost update after a crash costs one interval of counts.
            os.replace(tmp, self._dir / FILENAME)
            self._written = counts
        except FileNotFoundError:
            pass
        except Exception as exc:  # only people read it: serving is unaffected
            log.warning("spoolctl: could not record the hit rate in %s: %s", self._dir,
                        getattr(exc, "message", exc))
        finally:
            self._busy.release()
