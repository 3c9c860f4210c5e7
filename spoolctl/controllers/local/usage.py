"""Usage accounting of the local controllers: one rule, pure.

A ``generate`` call's prompt is served partly from a cache and partly computed. The
cache is what a ``prepare`` produced; that prepare either read it (from memory, or
from the store's disk) or computed it (cold prefill, or the suffix of an incremental
prefill on a base that was itself read from memory or disk) and wrote it. So the
truth about a call depends on whether its prepare's work has been reported yet:

* ``generate(params)`` prepares itself: its usage includes that work.
* ``generate(handle)``: the first call using a handle reports the work of the prepare
  that made it (``PrepareWork``); later calls with the same handle read the cache
  from memory (or from disk, if it had been evicted and was reloaded by the call).

Of the ``cached`` prompt tokens a call continued from, those the prepare read count as
``cache_memory_tokens`` / ``cache_disk_tokens`` and those it computed as computed
tokens; ``cache_write_tokens`` is what the prepare committed to the store.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..contract import Usage


@dataclass(frozen=True)
class PrepareWork:
    """What one ``prepare`` call did, in tokens of the cacheable prefix."""

    memory: int = 0  # read from a cache already in memory (memory hit, coalesced, base)
    disk: int = 0  # read and verified from the store (disk hit, or a base on disk)
    computed: int = 0  # prefilled (cold, or the suffix of an incremental prefill)
    written: int = 0  # committed to the store


def call_usage(work: PrepareWork | None, *, cached: int, prompt_tokens: int,
               completion_tokens: int, reloaded: bool = False) -> Usage:
    """The usage of one generate call that continued from ``cached`` prompt tokens.

    ``work``: the unreported work of the handle's prepare, or None when it was already
    reported (then the cache was read from memory, or from disk when ``reloaded``).
    """
    if work is None:
        work = PrepareWork(disk=cached) if reloaded else PrepareWork(memory=cached)
    memory = min(work.memory, cached)
    disk = min(work.disk, cached - memory)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 cache_read_tokens=memory + disk, cache_write_tokens=work.written,
                 cache_memory_tokens=memory, cache_disk_tokens=disk)


@dataclass
class ControllerStats:
    """Counters of one controller (``stats()``)."""

    queries: int = 0
    prepares: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    coalesced: int = 0
    cold_prefills: int = 0
    incremental_prefills: int = 0
    tokens_written: int = 0
    tokens_reused: int = 0
    load_failures: int = 0
    #: Misses because the same params rendered other prefix tokens than a stored entry
    #: (a chat template that renders the date): normal drift, not damage.
    prefix_moved: int = 0
    commit_failures: int = 0
    #: Store calls skipped or abandoned because the disk did not answer within its deadline
    #: (``deadlines``): each one a miss or an unwritten cache, never a wait.
    disk_down: int = 0
    #: Prepares that ran without the cache because the model had changed in a way its
    #: backend cannot identify (a weight edited in memory, an unknown wrapper).
    bypassed: int = 0
