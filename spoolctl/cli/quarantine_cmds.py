"""``spoolctl quarantine ls|show|restore|purge``: inspect and manage corrupt evidence."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.panel import Panel
from rich.table import Table

from spoolctl.store import parse_duration
from spoolctl.store.quarantine import QuarantineItem

from . import render
from .app import app
from .common import EXIT_OK, JsonOption, RootOption, console, emit, open_store

quarantine_app = typer.Typer(
    name="quarantine", help="Inspect, restore and purge quarantined evidence.",
    no_args_is_help=True, rich_markup_mode="rich")
app.add_typer(quarantine_app, name="quarantine")

ItemArg = Annotated[str, typer.Argument(help="Item id as shown by `spoolctl quarantine ls`.")]


@quarantine_app.command("ls")
def q_ls(root: RootOption = None, json_output: JsonOption = False) -> None:
    """List quarantined items with their reason.

    Reasons: manifest_io, manifest_validation, payload_digest, payload_size,
    payload_missing, object_collision, catalog, unknown.

    Example: [bold]spoolctl quarantine ls --json[/bold]
    """
    with open_store(root) as store:
        items = store.quarantine_items()
    emit({"items": [i.to_json() for i in items], "count": len(items),
          "bytes": sum(i.bytes for i in items)}, json_output=json_output, view=_ls_view)


def _ls_view(doc: dict[str, Any]) -> Table:
    t = Table(title=f"{doc['count']} quarantined items", title_justify="left")
    for col in ("item", "reason", "entry", "size", "when"):
        t.add_column(col, no_wrap=True)
    for i in doc["items"]:
        t.add_row(i["item"], i["reason"], (i["entry_id"] or "-")[:12], render.size(i["bytes"]),
                  render.rel_time(i["time"]))
    return t


@quarantine_app.command("show")
def q_show(item: ItemArg, root: RootOption = None, json_output: JsonOption = False) -> None:
    """Show one item: reason, detail, entry, and the files it holds.

    Example: [bold]spoolctl quarantine show 20260101T120000Z-payload_digest-1a2b3c4d[/bold]
    """
    with open_store(root) as store:
        found = store.quarantine.get(item)
        files = sorted(p.name for p in found.path.iterdir())
    emit({**found.to_json(), "contents": files}, json_output=json_output, view=_show_view)


def _show_view(doc: dict[str, Any]) -> Panel:
    return Panel(
        f"reason   {doc['reason']}\ndetail   {doc['detail']}\nentry    {doc['entry_id'] or '-'}\n"
        f"kind     {doc['kind'] or '-'}\nwhen     {render.rel_time(doc['time'])}\n"
        f"size     {render.size(doc['bytes'])}\npath     {doc['path']}\n"
        f"files    {', '.join(doc['contents'])}", title=doc["item"], title_align="left")


@quarantine_app.command("restore")
def q_restore(item: ItemArg, root: RootOption = None, json_output: JsonOption = False) -> None:
    """Re-verify an item; re-admit its entry only if it now verifies.

    If it still fails, nothing is moved and the exit code is 1.

    Example: [bold]spoolctl quarantine restore 20260101T120000Z-payload_digest-1a2b3c4d[/bold]
    """
    with open_store(root) as store:
        manifest = store.restore_quarantined(item)
    emit({"item": item, "restored": True, "entry_id": manifest.entry_id},
         json_output=json_output,
         view=lambda doc: f"[green]restored[/green] entry {doc['entry_id']} from {doc['item']}")


def _select(items: list[QuarantineItem], older_than: float | None, now: float
            ) -> list[QuarantineItem]:
    return [i for i in items if older_than is None or now - i.time >= older_than]


@quarantine_app.command("purge")
def q_purge(
    root: RootOption = None,
    older_than: Annotated[str | None, typer.Option(
        "--older-than", help="Only items quarantined at least this long ago (e.g. 7d).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
    json_output: JsonOption = False,
) -> None:
    """Delete quarantined items (evidence is never deleted automatically).

    Example: [bold]spoolctl quarantine purge --older-than 7d --yes[/bold]
    """
    age = parse_duration(older_than) if older_than is not None else None
    ask = render.require_yes(yes, dry_run, "quarantine purge")
    with open_store(root) as store:
        chosen = _select(store.quarantine_items(), age, time.time())
        if ask and chosen:
            console.print(f"{len(chosen)} items, {render.size(sum(i.bytes for i in chosen))}")
            if not typer.confirm("Purge them?", default=False):
                raise typer.Exit(EXIT_OK)
        if not dry_run:
            for i in chosen:
                store.quarantine.remove(i)
    emit({"dry_run": dry_run, "purged": [i.item_id for i in chosen], "count": len(chosen),
          "bytes": sum(i.bytes for i in chosen)}, json_output=json_output, view=_purge_view)


def _purge_view(doc: dict[str, Any]) -> str:
    verb = "would purge" if doc["dry_run"] else "purged"
    return f"{verb} {doc['count']} items, {render.size(doc['bytes'])}"
