"""The progress bar of ``export`` and ``import``: bytes, entries and rate on stderr."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .common import err_console

if TYPE_CHECKING:
    from rich.progress import Progress


class TransferProgress:
    """Bytes, entries and rate on stderr (a terminal only), or nothing."""

    def __init__(self, label: str, enabled: bool):
        self.label = label
        self.enabled = enabled
        self._p: Progress | None = None
        self._task: Any = None
        self.entries = 0  # the last count reported, also when nothing is shown

    def __enter__(self) -> TransferProgress:
        if self.enabled:  # rich's progress is imported only when a bar is shown
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TransferSpeedColumn,
            )

            self._p = Progress(TextColumn(f"[bold]{self.label}"), BarColumn(),
                               DownloadColumn(binary_units=True), TransferSpeedColumn(),
                               TextColumn("{task.fields[entries]} entries"),
                               TimeElapsedColumn(), console=err_console.get(), transient=True)
            self._p.__enter__()
            self._task = self._p.add_task(self.label, total=None, entries=0)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._p is not None:
            self._p.__exit__(None, None, None)

    def shown(self) -> tuple[float, float | None, int] | None:
        """What the bar shows (done, total, entries); None when no bar is shown."""
        if self._p is None:
            return None
        task = self._p.tasks[0]
        return task.completed, task.total, task.fields["entries"]

    def __call__(self, done: int, entries: int, total: int | None = None) -> None:
        self.entries = entries
        if self._p is not None:
            # A planned total is an estimate (an import plans payload bytes, the stream
            # also carries headers): the bar never shows more done than its total.
            if total:
                self._p.update(self._task, completed=done, entries=entries,
                               total=max(total, done))
            else:
                self._p.update(self._task, completed=done, entries=entries)


def want_progress(flag: bool | None, json_output: bool) -> bool:
    if flag is not None:
        return flag
    return not json_output and err_console.is_terminal
