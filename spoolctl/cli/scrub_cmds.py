"""Verification commands: ``scrub`` (deep, resumable) and ``request-auth`` (one entry now)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from spoolctl.store import BusyError, CorruptionError, parse_rate
from spoolctl.store.auth_requests import AuthQueue, authenticate
from spoolctl.store.keys import validate_entry_prefix
from spoolctl.store.scrub import Scrubber

from . import render
from .app import app
from .common import EXIT_FINDINGS, JsonOption, RootOption, emit, open_store
from .targets import resolve_entry

DEFAULT_STEP_ITEMS = 10_000


def parse_rate_option(text: str) -> int | None:
    """``64MiB/s`` -> bytes per second; ``0`` or ``unlimited`` -> None (no pacing)."""
    if text.strip().lower() in ("0", "unlimited", "none"):
        return None
    return parse_rate(text)


@app.command("scrub")
def scrub_cmd(
    root: RootOption = None,
    rate: Annotated[str, typer.Option(
        "--rate", help="Byte rate limit, e.g. 64MiB/s (0 = unlimited).")] = "64MiB/s",
    max_items: Annotated[int, typer.Option(
        "--max-items", min=1, help="Verify at most N entries this run (resumes next run).")] =
        DEFAULT_STEP_ITEMS,
    until_complete: Annotated[bool, typer.Option(
        "--until-complete", help="Keep going until the current cycle completes.")] = False,
    json_output: JsonOption = False,
) -> None:
    """Deep scrub: re-read and verify every manifest and object at a bounded rate.

    Resumes where the last scrub stopped. Quarantines what fails (exit 1) and, at the
    end of a cycle, reclaims proven orphans and abandoned temp files.

    Example (cron): [bold]spoolctl scrub --rate 64MiB/s --until-complete[/bold]
    """
    rate_bytes = parse_rate_option(rate)
    with open_store(root) as store:
        total = store.totals().entries
        scrubber = Scrubber(store, rate_bytes=rate_bytes)
        with render.progress_bar("scrub", total, enabled=not json_output) as bar:
            report = scrubber.run(
                max_items=max_items, until_complete=until_complete, wait=True,
                progress=lambda cycle, n: bar.update(
                    completed=cycle.checked + cycle.quarantined + cycle.absent,
                    total=max(n, cycle.total_at_start, 1)))
    assert report is not None  # wait=True: BusyError instead of None
    emit(report.to_json(), json_output=json_output, view=_scrub_view)
    if report.quarantined:
        raise typer.Exit(EXIT_FINDINGS)


def _scrub_view(doc: dict[str, Any]) -> Table:
    t = Table(title=f"scrub cycle {doc['cycle_id']}{' (resumed)' if doc['resumed'] else ''}",
              show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    t.add_row("authenticated", f"{doc['checked']} entries, {render.size(doc['bytes'])}")
    found = doc["quarantined"]
    t.add_row("quarantined", f"[red]{len(found)}[/red]" if found else "0")
    for q in found[:20]:
        t.add_row("", f"{q['entry_id'][:16]}  {q['reason']}")
    t.add_row("deleted meanwhile", str(doc["absent"]))
    t.add_row("cycle", "complete" if doc["cycle_completed"] else
              "in progress (run again to continue)")
    if doc["cycle_completed"]:
        t.add_row("orphans reclaimed", f"{doc['orphans'].get('objects', 0)} objects, "
                  f"{render.size(doc['orphans'].get('bytes', 0))}")
        t.add_row("temp files reclaimed", f"{doc['tmp'].get('files', 0)}, "
                  f"{render.size(doc['tmp'].get('bytes', 0))}")
    t.add_row("time", f"{doc['seconds']:.2f}s")
    return t


@app.command("request-auth")
def request_auth_cmd(
    entry: Annotated[str, typer.Argument(help="Entry id (64 hex) or unique prefix.")],
    root: RootOption = None,
    wait: Annotated[bool, typer.Option(
        "--wait", help="When a worker owns the store, wait for its receipt.")] = False,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=0.0, help="Seconds to wait for the receipt.")] = 60.0,
    json_output: JsonOption = False,
) -> None:
    """Authenticate one entry now: authenticated (0), absent or quarantined (1).

    If a live worker owns the store the request is queued for it.

    Example: [bold]spoolctl request-auth 3fa9c2d1 --wait --timeout 30[/bold]
    """
    validate_entry_prefix(entry)
    with open_store(root) as store:
        if len(entry) == 64:
            entry_id = entry  # a full id that is not there is an answer: absent
        else:
            try:
                entry_id = resolve_entry(store, entry)
            except CorruptionError as exc:  # the prefix names an entry already quarantined
                entry_id = exc.entry_id or entry
        owner = store.owner()
        if owner is None:
            result = authenticate(store, entry_id)
        else:
            with AuthQueue.of(store) as queue:
                request_id = queue.submit(entry_id)
                if not wait:
                    doc = {"entry_id": entry_id, "result": "queued", "request_id": request_id,
                           "owner": owner.to_json()}
                    emit(doc, json_output=json_output, view=_queued_view)
                    return
                result = queue.wait(request_id, timeout)
            if result is None:
                raise BusyError(
                    f"no receipt from the owner ({owner.role} pid {owner.pid}) within "
                    f"{timeout:g}s; request {request_id} stays queued",
                    path=store.root, fix="retry with a longer --timeout, or check the worker")
    emit(result.to_json(), json_output=json_output, view=_auth_view)
    if result.result != "authenticated":
        raise typer.Exit(EXIT_FINDINGS)


def _queued_view(doc: dict[str, Any]) -> str:
    owner = doc["owner"]
    return (f"queued request {doc['request_id']} for {owner['role']} pid {owner['pid']}; "
            "rerun with --wait to wait for the receipt")


_RESULT_COLORS = {"authenticated": "green", "absent": "yellow", "quarantined": "red"}


def _auth_view(doc: dict[str, Any]) -> str:
    color = _RESULT_COLORS[doc["result"]]
    extra = f" ({doc['reason']})" if doc.get("reason") else ""
    return (f"[{color}]{doc['result']}[/{color}]{extra}  {doc['entry_id']}  {doc['detail']}"
            f"{'  via owner' if doc.get('via') == 'owner' else ''}")
