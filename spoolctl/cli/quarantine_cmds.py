"""``spoolctl quarantine ls|show|restore|purge``: inspect and manage corrupt evidence, on
one store or on every rank store of a vLLM deployment directory or base root (an item id
is looked for in each). Reasons and details come from the store: shown as plain text."""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from spoolctl.store import ConfigError, NotFoundError, parse_duration

from . import render
from .common import (
    EXIT_FINDINGS,
    EXIT_OK,
    DeploymentOption,
    JsonOption,
    RankOption,
    RootOption,
    View,
    console,
    emit,
    esc,
    open_store,
    plain,
    text,
)
from .entry_cmds import found_in
from .fanout import StoreJob, finish, multi_doc, multi_view, run_each, run_on_targets
from .targets import StoreTarget, Targets, resolve_targets

if TYPE_CHECKING:
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    from spoolctl.store import QuarantineItem, Store

# This module's commands: cli/commands.py adds them to the spoolctl app (the one place
# that lists every command).
commands = typer.Typer()

quarantine_app = typer.Typer(
    name="quarantine", help="Inspect, restore and purge quarantined evidence.",
    no_args_is_help=True, rich_markup_mode="rich")
commands.add_typer(quarantine_app, name="quarantine")

ItemArg = Annotated[str, typer.Argument(
    help="Item id as shown by `spoolctl quarantine ls`, or a unique prefix of one (at least "
    f"{4} characters).")]
_PREFIX = re.compile(r"[0-9A-Za-z_-]{4,63}")


def check_item(typed: str) -> str:
    """``typed`` if it can name an item: a whole id or a prefix of at least 4 characters."""
    from spoolctl.store import validate_item_id
    if _PREFIX.fullmatch(typed):
        return typed
    return validate_item_id(typed)  # raises the usual "invalid quarantine item"


def resolve_item(items: list[QuarantineItem], typed: str) -> str:
    """The item id ``typed`` names: itself, or the one item whose id starts with it (ids are
    long, and a table on a narrow terminal wraps them; kubectl/git accept unique prefixes).
    Unknown: NotFoundError (exit 1); ambiguous: ConfigError naming how many (exit 2)."""
    ids = [i.item_id for i in items]
    if typed in ids:
        return typed
    hits = [i for i in ids if i.startswith(check_item(typed))]
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise ConfigError(f"quarantine item prefix {typed!r} matches {len(hits)} items",
                          fix="type more of the id (see `spoolctl quarantine ls`)")
    raise NotFoundError(f"no quarantine item {typed}",
                        fix="list items with `spoolctl quarantine ls`")


@quarantine_app.command("ls")
def q_ls(root: RootOption = None, rank: RankOption = None, deployment: DeploymentOption = None,
         json_output: JsonOption = False) -> None:
    """List quarantined items with their reason.

    Reasons: manifest_io, manifest_validation, payload_digest, payload_size,
    payload_missing, object_collision, catalog, scrub_state, auth_queue, auth_tag, unknown.

    Example: [bold]spoolctl quarantine ls --json[/bold]
    """
    def job(store: Store, _target: StoreTarget) -> tuple[dict[str, Any], int]:
        items = store.quarantine_items()
        return {"items": [i.to_json() for i in items], "count": len(items),
                "bytes": sum(i.bytes for i in items)}, EXIT_OK

    finish(run_on_targets(resolve_targets(root, rank=rank, deployment=deployment), job,
                          json_output=json_output, view=_ls_view, read_only_ok=True))


def _ls_view(doc: dict[str, Any]) -> Table | Text:
    """A table on a terminal (cells wrap, never cut); piped, plain columns, ids whole."""
    from rich.table import Table
    if not console.is_terminal:
        return render.columns(("item", "reason", "entry", "size", "when"), [
            [i["item"], i["reason"], i["entry_id"] or "-", render.size(i["bytes"]),
             render.past_time(i["time"])] for i in doc["items"]])
    t = Table(title=render.count(doc["count"], "quarantined item"), title_justify="left")
    for col in ("item", "reason", "entry", "size", "when"):
        t.add_column(col, no_wrap=col in ("size", "when"), overflow="fold")
    for i in doc["items"]:
        t.add_row(text(i["item"]), text(i["reason"]), text((i["entry_id"] or "-")[:12]),
                  render.size(i["bytes"]), render.past_time(i["time"]))
    return t


def _on_item(targets: Targets, item: str, job: StoreJob, *, json_output: bool, view: View,
             read_only_ok: bool = False) -> None:
    """Run ``job`` on the store holding quarantine item ``item`` (any rank store)."""
    check_item(item)
    if targets.single:
        finish(run_on_targets(targets, job, json_output=json_output, view=view,
                              read_only_ok=read_only_ok))
        return
    results = found_in(run_each(targets, job, read_only_ok=read_only_ok),
                       f"no quarantine item {item} under {targets.given}")
    doc = multi_doc(targets, results)
    emit(doc, json_output=json_output, view=multi_view(view))
    finish(doc["exit"])


@quarantine_app.command("show")
def q_show(item: ItemArg, root: RootOption = None, rank: RankOption = None,
           deployment: DeploymentOption = None, json_output: JsonOption = False) -> None:
    """Show one item: reason, detail, entry, and the files it holds.

    Example: [bold]spoolctl quarantine show 20260101T120000Z-payload_digest-1a2b3c4d[/bold]
    """
    def job(store: Store, _target: StoreTarget) -> tuple[dict[str, Any], int]:
        found = store.quarantine.get(resolve_item(store.quarantine_items(), item))
        try:
            files = sorted(found.files_present())
        except OSError:
            files = []
        return {**found.to_json(), "contents": files}, EXIT_OK

    _on_item(resolve_targets(root, rank=rank, deployment=deployment), item, job,
             json_output=json_output, view=_show_view, read_only_ok=True)


def _show_view(doc: dict[str, Any]) -> Panel:
    from rich.panel import Panel
    from rich.text import Text
    body = Text(
        f"reason   {plain(doc['reason'])}\ndetail   {plain(doc['detail'])}\n"
        f"entry    {plain(doc['entry_id'] or '-')}\nkind     {plain(doc['kind'] or '-')}\n"
        f"when     {render.past_time(doc['time'])}\nsize     {render.size(doc['bytes'])}\n"
        f"path     {plain(doc['path'])}\nfiles    {plain(', '.join(doc['contents']))}")
    return Panel(body, title=esc(doc["item"]), title_align="left")


@quarantine_app.command("restore")
def q_restore(item: ItemArg, root: RootOption = None, rank: RankOption = None,
              deployment: DeploymentOption = None, json_output: JsonOption = False) -> None:
    """Re-verify an item; re-admit its entry only if it now verifies.

    If it still fails, nothing is moved and the exit code is 1; if an object it needs was
    reclaimed meanwhile, it says so and how to purge the item (exit 1).

    Example: [bold]spoolctl quarantine restore 20260101T120000Z-payload_digest-1a2b3c4d[/bold]
    """
    def job(store: Store, _target: StoreTarget) -> tuple[dict[str, Any], int]:
        whole = resolve_item(store.quarantine_items(), item)
        manifest = store.restore_quarantined(whole)
        return {"item": whole, "restored": True, "entry_id": manifest.entry_id}, EXIT_OK

    _on_item(resolve_targets(root, rank=rank, deployment=deployment), item, job,
             json_output=json_output,
             view=lambda doc: f"[green]restored[/green] entry {esc(doc['entry_id'])} from "
                              f"{esc(doc['item'])}")


def _select(items: list[QuarantineItem], older_than: float | None, now: float,
            wanted: list[str]) -> list[QuarantineItem]:
    return [i for i in items if (older_than is None or now - i.time >= older_than)
            and (not wanted or i.item_id in wanted)]


@quarantine_app.command("purge")
def q_purge(
    items: Annotated[list[str] | None, typer.Argument(
        help="The item ids to purge (or --older-than, or --all).",
        show_default=False)] = None,
    root: RootOption = None,
    older_than: Annotated[str | None, typer.Option(
        "--older-than", help="Only items quarantined at least this long ago (e.g. 7d).")] = None,
    all_items: Annotated[bool, typer.Option(
        "--all", help="Every item (needed when neither ids nor --older-than are given).")] =
        False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
    rank: RankOption = None,
    deployment: DeploymentOption = None,
    json_output: JsonOption = False,
) -> None:
    """Delete quarantined items (evidence is never deleted automatically).

    Say which: item ids, `--older-than`, or `--all` (nothing is purged by default).

    Example: [bold]spoolctl quarantine purge --older-than 7d --yes[/bold]
    """
    wanted = [check_item(i) for i in (items or [])]
    age = parse_duration(older_than) if older_than is not None else None
    if not wanted and age is None and not all_items:
        raise ConfigError("quarantine purge needs the items to purge",
                          fix="give item ids (`spoolctl quarantine ls`), --older-than 7d, "
                          "or --all for every item")
    if all_items and (wanted or age is not None):
        raise ConfigError("--all purges every item: it does not combine with ids or "
                          "--older-than", fix="drop --all, or the ids and --older-than")
    ask = render.require_yes(yes, dry_run, "quarantine purge")
    targets = resolve_targets(root, rank=rank, deployment=deployment)
    if wanted:  # unique prefixes -> whole ids, before anything is purged
        known: list[QuarantineItem] = []
        for target in targets.stores:
            with open_store(target.root, read_only_ok=True) as store:
                known += store.quarantine_items()
        wanted = [resolve_item(known, w) for w in wanted]
    now = time.time()
    if ask or wanted:
        chosen = []
        for target in targets.stores:
            with open_store(target.root, read_only_ok=True) as store:
                chosen += _select(store.quarantine_items(), age, now, wanted)
        missing = sorted(set(wanted) - {i.item_id for i in chosen})
        if missing:  # checked before anything is purged
            raise NotFoundError(f"no quarantine item {missing[0]}", path=targets.given,
                                fix="list items with `spoolctl quarantine ls`")
        if ask and chosen:
            console.print(f"{render.count(len(chosen), 'item')}, "
                          f"{render.size(sum(i.bytes for i in chosen))}")
            if not typer.confirm("Purge them?", default=False):
                raise typer.Exit(EXIT_OK)

    def job(store: Store, _target: StoreTarget) -> tuple[dict[str, Any], int]:
        chosen = _select(store.quarantine_items(), age, now, wanted)
        skipped = [] if dry_run else _remove_items(store, chosen)
        done = [i for i in chosen if i.item_id not in {s["item"] for s in skipped}]
        return {"dry_run": dry_run, "purged": [i.item_id for i in done],
                "count": len(done), "bytes": sum(i.bytes for i in done),
                "skipped": skipped}, EXIT_FINDINGS if skipped else EXIT_OK

    finish(run_on_targets(targets, job, json_output=json_output, view=_purge_view))


def _remove_items(store: Store, chosen: list[QuarantineItem]) -> list[dict[str, Any]]:
    """Purge ``chosen``; the items left partly in place (a planted tree too deep to walk),
    each with what was kept and the fix."""
    skipped = []
    for i in chosen:
        kept = store.quarantine.remove(i)
        if kept:
            skipped.append({
                "item": i.item_id, "path": str(i.path), "kept": kept[:10],
                "reason": f"{render.count(len(kept), 'directory', 'directories')} deeper "
                          f"than {store.quarantine.max_depth} levels (spoolctl never writes "
                          "one: someone planted it)",
                "fix": f"look at who wrote it, then remove it: rm -rf -- {i.path}"})
    return skipped


def _purge_view(doc: dict[str, Any]) -> str:
    verb = "would purge" if doc["dry_run"] else "purged"
    lines = [f"{verb} {render.count(doc['count'], 'item')}, {render.size(doc['bytes'])}"]
    lines += [f"skipped {esc(s['item'])}: {esc(s['reason'])}; {esc(s['fix'])}"
              for s in doc["skipped"]]
    return "\n".join(lines)
