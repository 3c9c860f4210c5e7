"""Watching a store's health: ``metrics`` (Prometheus gauges from the store's facts) and
``doctor`` (checks of the root, filesystem and SQLite files)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from spoolctl.store import ConfigError

from .app import app
from .common import EXIT_FINDINGS, JsonOption, RootOption, emit, open_store, resolve_root


@app.command("metrics")
def metrics_cmd(
    root: RootOption = None,
    textfile: Annotated[Path | None, typer.Option(
        "--textfile", help="Write atomically to this .prom file (node_exporter textfile "
        "collector) instead of stdout.")] = None,
) -> None:
    """Print store gauges in Prometheus exposition format.

    Example: [bold]spoolctl metrics --textfile /var/lib/node_exporter/textfile/spoolctl.prom[/bold]
    """
    from spoolctl.metrics import render_store_metrics

    if textfile is not None:
        _check_textfile(textfile)
    with open_store(root) as store:
        text = render_store_metrics(store)
    if textfile is None:
        typer.echo(text, nl=False)
        return
    _write_atomic(textfile, text.encode())


def _check_textfile(path: Path) -> None:
    if not path.is_absolute():
        raise ConfigError("--textfile must be an absolute path", path=str(path),
                          fix="pass e.g. /var/lib/node_exporter/textfile/spoolctl.prom")
    if path.suffix != ".prom":
        raise ConfigError("--textfile must end in .prom (node_exporter ignores others)",
                          path=path, fix="rename it to *.prom")
    if not path.parent.is_dir():
        raise ConfigError("the --textfile directory does not exist", path=path.parent,
                          fix="create it or point --textfile elsewhere")


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a same-directory temp file + rename, so a reader
    (node_exporter) never sees a partial file. Mode 0644: node_exporter runs as another
    user (outside a store, so not the store's private ``publish`` path)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise ConfigError(f"cannot write the metrics file: {os.strerror(exc.errno or 0)}",
                          path=path, fix="check the directory's permissions") from None


@app.command("doctor")
def doctor_cmd(root: RootOption = None, json_output: JsonOption = False) -> None:
    """Check the root, the filesystem and SQLite health; print what to fix.

    Root: marker, permissions, owner. Filesystem: type, free space vs max size, O_DIRECT,
    fsync. Exit 1 when a check fails.

    Example: [bold]spoolctl doctor --root /var/cache/spoolctl[/bold]
    """
    from spoolctl.store.doctor import run_checks

    path = resolve_root(root)
    checks = run_checks(path)
    failed = any(c.status == "fail" for c in checks)
    emit({"root": str(path), "ok": not failed, "checks": [c.to_json() for c in checks]},
         json_output=json_output, view=_doctor_view)
    if failed:
        raise typer.Exit(EXIT_FINDINGS)


_COLORS = {"ok": "green", "warn": "yellow", "fail": "red"}


def _doctor_view(doc: dict[str, Any]) -> Table:
    t = Table(title=f"doctor {doc['root']}", title_justify="left")
    for col in ("check", "status", "detail", "fix"):
        t.add_column(col)
    for c in doc["checks"]:
        color = _COLORS[c["status"]]
        t.add_row(c["name"], f"[{color}]{c['status']}[/{color}]", c["detail"], c["fix"])
    return t
