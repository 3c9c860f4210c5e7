"""How a command stops at Ctrl-C (SIGINT) or SIGTERM: at once, saying what it did, 130/143.

SIGINT already raises ``KeyboardInterrupt`` in the main thread; ``signals_as_interrupts``
makes SIGTERM (systemd, ``kill``, a timeout wrapper) do the same with ``Terminated``, a
``KeyboardInterrupt``, so one path -- every ``finally`` and ``with`` block on the way out --
cleans up for both: an export's temp archive is removed, an import's staged files too, a
store is closed. Nothing else changes for the store: every commit is crash-safe anyway.

The exit status is the shell's convention for death by a signal, ``128 + signal number``:
130 for SIGINT, 143 for SIGTERM. It is distinct from every documented result
code (0 ok, 1 findings, 2 usage), so a cron wrapper or a script can tell "stopped" from
"failed".
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

EXIT_SIGINT = 128 + signal.SIGINT  # 130
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like SIGINT's ``KeyboardInterrupt``."""


# The interrupt raised by our handlers and not yet reported. typer turns a
# KeyboardInterrupt into a silent ``Exit(130)`` return code, losing which signal it was and
# that it was one at all; ``main`` asks here (``take``).
_pending: KeyboardInterrupt | None = None


def _raise_interrupt(signum: int, frame: object) -> None:
    global _pending
    _pending = Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
    raise _pending


@contextlib.contextmanager
def signals_as_interrupts() -> Iterator[None]:
    """Inside, SIGINT raises ``KeyboardInterrupt`` and SIGTERM ``Terminated`` in the main
    thread, both remembered for ``take`` (previous handlers restored on the way out). A
    signal the parent ignores (``nohup``, a background job) stays ignored. Outside the main
    thread (an embedding application) it does nothing: only the main thread may set
    handlers, and the host owns its signals."""
    global _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _pending = None
    previous = {}
    for signum, default in ((signal.SIGINT, signal.default_int_handler),
                            (signal.SIGTERM, signal.SIG_DFL)):
        if signal.getsignal(signum) is default:
            previous[signum] = signal.signal(signum, _raise_interrupt)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def take() -> KeyboardInterrupt | None:
    """The interrupt not yet reported (and forget it), or None."""
    global _pending
    exc, _pending = _pending, None
    return exc


def reported() -> None:
    """A command printed what it did before exiting 130/143: ``main`` adds nothing."""
    take()


def interrupt_of(exc: BaseException | None) -> KeyboardInterrupt | None:
    """The ``KeyboardInterrupt`` (or ``Terminated``) that ``exc`` is or was raised from
    (typer turns one into ``Exit(130)``, click into ``Abort``, with it as the cause), else
    None. A context suppressed with ``from None`` does not count: that command has already
    said what it did."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        seen += 1
    return None


def exit_code(exc: BaseException) -> int:
    """130 for SIGINT, 143 for SIGTERM (see the module docstring)."""
    return EXIT_SIGTERM if isinstance(exc, Terminated) else EXIT_SIGINT


def signal_name(exc: BaseException) -> str:
    return "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
