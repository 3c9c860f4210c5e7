"""Rendering helpers for people: relative times, sizes, short ids, progress, confirmation.

Pure formatting functions (``rel_time``, ``short_id``, ``expiry_text``) are kept
free of I/O so they can be unit-tested; the rest decides what a terminal gets
(colours and progress bars only on a TTY; rich honours ``NO_COLOR`` itself).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from spoolctl.store import ConfigError, format_size

from .common import err_console

if TYPE_CHECKING:
    from rich.progress import Progress
    from rich.text import Text


def size(n: int | float | None) -> str:
    return "-" if n is None else format_size(n)


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``1 entry`` / ``2 entries`` / ``0 items``: one way to say how many, everywhere."""
    if n == 1:
        return f"1 {noun}"
    if plural is None:
        plural = noun[:-1] + "ies" if noun.endswith("y") and noun[-2:-1] not in "aeiou" \
            else noun + "s"
    return f"{n} {plural}"


def columns(headers: tuple[str, ...] | list[str], rows: list[list[str]]) -> Text:
    """Plain columns for a pipe (``kubectl get`` style): a header line in capitals, cells
    padded with two spaces, nothing cut or wrapped whatever the width; store text escaped
    (``plain``). Spaces inside a cell (``3m ago``) stay; the column widths keep it readable."""
    from rich.text import Text

    from .common import plain

    table = [[h.upper().replace(" ", "_") for h in headers],
             *[[plain(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in table) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in table]
    return Text("\n".join(lines))


def rel_time(t: float | None, now: float | None = None) -> str:
    """``3m ago`` / ``in 2h`` / ``never`` for a Unix time."""
    if not t:
        return "never"
    now = time.time() if now is None else now
    delta = now - t
    future = delta < 0
    delta = abs(delta)
    for unit, secs in (("d", 86400), ("h", 3600), ("m", 60)):
        if delta >= secs:
            text = f"{int(delta // secs)}{unit}"
            break
    else:
        text = f"{int(delta)}s"
    return f"in {text}" if future else f"{text} ago"


# A past time this far ahead of the clock was stamped by a clock that ran ahead (or this
# one is behind); less is the jitter between two processes' clocks.
FUTURE_SLACK_S = 2.0


def past_time(t: float | None, now: float | None = None) -> str:
    """``rel_time`` for a time that can only be in the past (created, last access). One
    from the future points at a clock problem and says so: ``in the future``, never
    ``0s ago`` (which hid it) nor ``in 364d``."""
    now = time.time() if now is None else now
    if t and t > now + FUTURE_SLACK_S:
        return "in the future"
    return rel_time(min(t, now) if t else t, now)


def short_id(entry_id: str, n: int = 12) -> str:
    return entry_id[:n]


def expiry_text(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds <= 0:
        return "expired"
    return rel_time(time.time() + seconds)


def stderr_is_tty() -> bool:
    return bool(err_console.is_terminal)


def stdin_is_tty() -> bool:
    try:
        return sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False


def require_yes(yes: bool, dry_run: bool, what: str) -> bool:
    """Enforce the destructive-command rule; return True if the caller must ask first.

    Not interactive and no ``--yes``: a ConfigError (exit 2). Interactive without
    ``--yes``: the caller shows the dry-run plan and asks.
    """
    if yes or dry_run:
        return False
    if not stdin_is_tty():
        raise ConfigError(f"{what} deletes data and stdin is not a terminal",
                          fix="add --yes to confirm, or --dry-run to see what it would do")
    return True


@contextmanager
def progress_bar(description: str, total: int, enabled: bool) -> Iterator[Any]:
    """A rich progress bar on stderr when ``enabled`` and stderr is a terminal, else
    a silent stand-in with the same ``update(completed=...)`` method (for cron)."""
    if not enabled or not stderr_is_tty():
        yield _Silent()
        return
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
        TextColumn("{task.completed}/{task.total} entries"), TimeRemainingColumn(),
        console=err_console.get(), transient=True,
    )
    with progress:
        task = progress.add_task(description, total=max(total, 1))
        yield _Bar(progress, task)


class _Silent:
    def update(self, **_: Any) -> None:
        return None


class _Bar:
    def __init__(self, progress: Progress, task: Any):
        self._p = progress
        self._t = task

    def update(self, **kw: Any) -> None:
        self._p.update(self._t, **kw)
