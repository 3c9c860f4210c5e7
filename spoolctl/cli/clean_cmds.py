"""``spoolctl clean``: the cron job. The store plans and runs the deletions as data
(``Store.clean``); this command parses, asks (interactive, without ``--yes``) and renders."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from spoolctl.store import CLEAN_STEPS, Store, parse_duration

from . import render
from .app import app
from .common import EXIT_FINDINGS, EXIT_OK, JsonOption, RootOption, console, emit, open_store


@app.command("clean")
def clean_cmd(
    root: RootOption = None,
    released: Annotated[bool, typer.Option("--released", help="Delete released entries.")] = False,
    orphans: Annotated[bool, typer.Option(
        "--orphans", help="Reconcile catalog and disk; delete unreferenced objects.")] = False,
    tmp: Annotated[bool, typer.Option("--tmp", help="Delete abandoned temp files.")] = False,
    capacity: Annotated[bool, typer.Option(
        "--capacity", help="Evict down to 90% of max size if over it.")] = False,
    genai: Annotated[bool, typer.Option(
        "--genai", help="First delete released/expired Gemini/Vertex caches on their server "
        "(credentials from GEMINI_API_KEY/GOOGLE_API_KEY or Google default credentials).")] =
        False,
    min_age: Annotated[str, typer.Option(
        "--min-age", help="Orphans and temp files must be this old (e.g. 1h).")] = "1h",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report; change nothing.")] =
        False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask (needed under cron).")] =
        False,
    json_output: JsonOption = False,
) -> None:
    """Delete what is safe to delete (the cron job).

    Released entries, capacity overflow, abandoned temp files and orphan objects: all
    four when no selector is given.

    Example (cron): [bold]spoolctl clean --yes --json[/bold]
    """
    age = parse_duration(min_age)
    chosen = {"released": released, "capacity": capacity, "tmp": tmp, "orphans": orphans}
    steps = [step for step in CLEAN_STEPS if chosen[step]] or list(CLEAN_STEPS)
    ask = render.require_yes(yes, dry_run, "clean")
    with open_store(root) as store:
        if ask:
            plan = store.clean(steps, min_age=age, dry_run=True)
            console.print(_steps_table(plan.steps_json(), True))
            if not typer.confirm("Delete these?", default=False):
                raise typer.Exit(EXIT_OK)
        remote = _clean_genai(store, genai, dry_run)  # before local cleanup: it settles holds
        report = store.clean(steps, min_age=age, dry_run=dry_run)
    emit({**report.to_json(), "genai": remote}, json_output=json_output, view=_clean_view)
    if report.quarantined or remote.get("failed"):
        raise typer.Exit(EXIT_FINDINGS)


def _clean_genai(store: Store, enabled: bool, dry_run: bool) -> dict[str, Any]:
    """Server-side deletes owed by released/expired genai caches (``--genai``); without the
    flag, only say what was skipped."""
    from spoolctl.controllers.genai_records import pending_remote_deletes

    if not enabled:
        pending = pending_remote_deletes(store)
        lines = [f"skipped {len(pending)} genai cache(s) still to delete on the server: "
                 "rerun with --genai and credentials"] if pending else []
        return {"skipped_pending": len(pending), "lines": lines}
    from spoolctl.controllers.genai_clean import clean_remote

    report = clean_remote(store, dry_run=dry_run)
    return {**report.to_json(), "lines": report.lines()}


def _steps_table(steps: dict[str, dict[str, Any]], dry_run: bool) -> Table:
    t = Table(title="would delete (dry run)" if dry_run else "deleted", title_justify="left")
    for col in ("step", "entries", "objects", "files", "bytes"):
        t.add_column(col, justify="left" if col == "step" else "right")
    for step, r in steps.items():
        t.add_row(step, str(r.get("entries", 0)), str(r.get("objects", 0)),
                  str(r.get("files", 0)), render.size(r.get("bytes", 0)))
    return t


def _clean_view(doc: dict[str, Any]) -> list[Any]:
    # Lines about remote caches carry server text: printed as plain text, never markup.
    return [_steps_table(doc["steps"], doc["dry_run"]),
            *(Text(line) for line in doc["genai"].get("lines", []))]
