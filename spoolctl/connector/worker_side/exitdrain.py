"""Commit what was captured before the interpreter's thread pools go away (bounded).

The most common offline use is ``LLM(...).generate(prompts)`` and then the process exits.
At interpreter exit CPython first runs the hooks registered with
``threading._register_atexit`` (``concurrent.futures`` shuts every thread pool down from
one of them), joins non-daemon threads, and only then runs ``atexit`` handlers, where
vLLM's own engine shutdown (and so ``SpoolConnector.shutdown``) runs. A commit still
queued then fails ("cannot schedule new futures after shutdown": the store's fsync
helper pool is gone) and the chunks computed last are lost.

``register(drainable)`` adds an object with ``flush(timeout) -> bool`` (a ``ChunkStager``)
to a process-wide set drained by one hook registered with ``threading._register_atexit``
the first time. Hooks run last-registered-first, and ``concurrent.futures`` registered its
own when ``spoolctl.store`` was imported (before any connector exists), so this drain runs
while the pools still work. The drain is bounded: ``EXIT_DRAIN_S`` for every registered
object together; what is left after it is skipped (a warning says so), never waited for.
Members are weakly held and ``unregister``-ed at shutdown.

No torch, no vLLM: tested on its own (``tests/test_vllm_exit.py``).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Protocol

log = logging.getLogger("spoolctl.connector")

# The whole exit drain, every rank of the process together. A staging budget of 512 MiB
# commits in ~2 s on a disk writing 250 MB/s; vLLM's multiprocess engine gives its engine
# process 5 s after SIGTERM before killing it (see docs/connector.md, "Exit").
EXIT_DRAIN_S = 30.0


class Drainable(Protocol):
    def flush(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` seconds) for queued commits; False if some are left."""


_lock = threading.Lock()
_members: weakref.WeakSet = weakref.WeakSet()
_hooked = False


def register(member: Drainable) -> None:
    """Drain ``member`` at interpreter exit (before the thread pools shut down)."""
    global _hooked
    with _lock:
        _members.add(member)
        if _hooked:
            return
        hook = getattr(threading, "_register_atexit", None)
        try:
            if hook is None:
                raise RuntimeError("no threading._register_atexit")
            hook(drain_all)
        except RuntimeError:
            # Not CPython, or the interpreter is already exiting: a plain atexit handler
            # still runs before vLLM's (registered earlier, run later) engine shutdown.
            atexit.register(drain_all)
        _hooked = True


def unregister(member: Drainable) -> None:
    with _lock:
        _members.discard(member)


def drain_all(timeout: float | None = None) -> bool:
    """Flush every registered member within ``timeout`` (default ``EXIT_DRAIN_S``) in all;
    True if everything queued was committed (or skipped with a reason)."""
    budget = EXIT_DRAIN_S if timeout is None else timeout
    deadline = time.monotonic() + budget
    with _lock:
        members = list(_members)
    complete = True
    for member in members:
        left = max(0.0, deadline - time.monotonic())
        try:
            done = member.flush(left)
        except Exception:  # never let a drain problem turn an exit into a traceback
            log.exception("spoolctl: exit drain failed")
            done = False
        if not done:
            complete = False
    if not complete:
        log.warning("spoolctl: exiting with chunks still uncommitted after %.0f s; "
                    "they are not stored (the next run recomputes them)", budget)
    return complete


# -- vLLM's own shutdown: drain or kill ---------------------------------------

DRAIN_FLAG = "--shutdown-timeout 30"
_warned_no_drain = False


def warn_without_drain(vllm_config: object) -> bool:
    """Warn once per process when vLLM will kill its engine at SIGTERM without draining.

    vLLM's ``shutdown_timeout`` (``--shutdown-timeout``, default 0) is how long a stopping
    server lets in-flight work finish; at 0 the engine process is killed at once and the
    chunks still queued for commit are lost, while a restart can use only what is on disk.
    Returns True if it warned (now or before). A config without the field (another vLLM
    version) is not judged."""
    global _warned_no_drain
    timeout = getattr(vllm_config, "shutdown_timeout", None)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout > 0:
        return False
    if not _warned_no_drain:
        _warned_no_drain = True
        log.warning("spoolctl: vLLM runs with shutdown_timeout=0: at SIGTERM it kills the "
                    "engine without a drain and the chunks still queued for the store are "
                    "lost (a restart recomputes them); start vLLM with %s "
                    "(see `spoolctl config vllm`, docs/connector.md)", DRAIN_FLAG)
    return True
