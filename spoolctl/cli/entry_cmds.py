"""Looking at entries: ``ls`` and ``inspect``, on one store or on every rank store of a
vLLM deployment directory or base root (``targets``, ``fanout``).

Everything shown here comes from the store (keys, namespaces, meta, display names), so
every cell goes through ``common.text`` / ``common.esc``: data, never markup or
terminal control sequences.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from spoolctl.store import NotFoundError, validate_entry_prefix, validate_kind

from . import render
from .common import (
    EXIT_FINDINGS,
    EXIT_OK,
    DeploymentOption,
    JsonOption,
    RankOption,
    RootOption,
    console,
    emit,
    plain,
    text,
)
from .fanout import StoreJob, StoreResult, finish, multi_doc, multi_view, run_each, run_on_targets
from .targets import StoreTarget, resolve_entry, resolve_targets

if TYPE_CHECKING:
    from rich.table import Table
    from rich.text import Text

    from spoolctl.store import CatalogRow, Store

# This module's commands: cli/commands.py adds them to the spoolctl app (the one place
# that lists every command).
commands = typer.Typer()


class HintChoice(str, enum.Enum):
    retain = "retain"
    release = "release"


class SortChoice(str, enum.Enum):
    size = "size"
    age = "age"
    access = "access"


def _row_json(row: CatalogRow, now: float) -> dict[str, Any]:
    from spoolctl.controllers.genai.records import expires_in

    doc = row.to_json()
    # One name per concept (docs/json.md): `bytes`, as in status; `size` is kept one release
    # as a deprecated alias for scripts written against it.
    doc["bytes"] = doc["size"]
    exp = expires_in(row.index, now) if row.kind == "genai" else None
    if exp is not None:
        doc["expires_in_s"] = round(exp, 1)
        doc["name"] = row.index.get("name")
    return doc


@commands.command("ls")
def ls_cmd(
    root: RootOption = None,
    kind: Annotated[str | None, typer.Option("--kind", help="vllm, pytorch, mlx or genai.")] = None,
    hint: Annotated[HintChoice | None, typer.Option("--hint", help="retain or release.")] = None,
    sort: Annotated[SortChoice, typer.Option("--sort", help="size, age or access.")] =
        SortChoice.access,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Show at most N.")] = None,
    rank: RankOption = None,
    deployment: DeploymentOption = None,
    json_output: JsonOption = False,
) -> None:
    """List entries (newest access first by default); per rank store on a vLLM root.

    Example: [bold]spoolctl ls --kind vllm --hint release --sort size --limit 20[/bold]
    """
    if kind is not None:
        validate_kind(kind)
    targets = resolve_targets(root, rank=rank, deployment=deployment)

    def job(store: Store, _target: StoreTarget) -> tuple[dict[str, Any], int]:
        rows = store.entries(kind=kind, hint=hint.value if hint else None, sort=sort.value,
                             limit=limit)
        # A deletion removes the manifest before the row (manifest-last in reverse): a row
        # whose manifest is gone is an entry an interrupted clean or eviction was deleting.
        # It no longer exists (`inspect` says so, a lookup misses), so it is not listed;
        # the next clean or open drops the row.
        listed = [r for r in rows if store.layout.manifest_path(r.entry_id).exists()]
        now = time.time()
        return {"entries": [_row_json(r, now) for r in listed], "count": len(listed),
                "being_deleted": len(rows) - len(listed)}, EXIT_OK

    finish(run_on_targets(targets, job, json_output=json_output, view=_ls_view,
                          read_only_ok=True))


_LS_COLUMNS = ("id", "kind", "namespace", "size", "hint", "created", "last access", "expires")


def _ls_view(doc: dict[str, Any]) -> Table | Text:
    """On a terminal a table (ids shortened to the 12-character prefix `inspect` accepts;
    cells wrap, never cut); piped, plain columns with whole ids and no width limit (like
    `kubectl get`), so `ls | grep | awk` sees every field whole."""
    from rich.table import Table
    now = time.time()
    gone = doc.get("being_deleted") or 0
    note = f" ({gone} more being deleted by an interrupted clean: `spoolctl clean` " \
        "finishes it)" if gone else ""
    piped = not console.is_terminal

    def row(r: dict[str, Any]) -> list[str]:
        return [r["entry_id"] if piped else render.short_id(r["entry_id"]), r["kind"],
                r["namespace"], render.size(r["bytes"]), r["hint"],
                render.past_time(r["created"], now), render.past_time(r["last_access"], now),
                render.expiry_text(r.get("expires_in_s")) or "-"]

    if piped:
        return render.columns(_LS_COLUMNS, [row(r) for r in doc["entries"]])
    t = Table(title=render.count(doc["count"], "entry") + note, title_justify="left")
    for col in _LS_COLUMNS:
        t.add_column(col, justify="right" if col == "size" else "left",
                     no_wrap=col in ("id", "size"), overflow="fold",
                     min_width=8 if col == "namespace" else None)
    for r in doc["entries"]:
        cells = row(r)
        t.add_row(*cells[:2], text(cells[2]), *cells[3:])
    return t


def entry_doc(store: Store, entry_id: str) -> dict[str, Any]:
    """What ``inspect`` shows of one entry: manifest, catalog row, objects present."""
    row = store.row(entry_id)
    manifest = store.manifest(entry_id)  # validates; quarantines a bad one (exit 1)
    objects = [{**ref.to_json(), "present": store.layout.object_path(ref.digest).is_file()}
               for ref in manifest.objects]
    doc = {
        "entry_id": entry_id, "kind": manifest.kind, "namespace": manifest.namespace,
        "key": manifest.key, "created": manifest.created, "supersedes": manifest.supersedes,
        "hint": row.hint if row else None, "last_access": row.last_access if row else None,
        "bytes": row.size if row else manifest.payload_bytes, "objects": objects,
        "meta": dict(manifest.meta), "index": dict(manifest.index),
    }
    doc["size"] = doc["bytes"]  # deprecated alias of `bytes` (docs/json.md)
    if manifest.kind == "genai":
        from spoolctl.controllers.genai.records import expires_in

        doc["expires_in_s"] = expires_in(dict(manifest.index), time.time())
    return doc


def _inspect_job(entry: str) -> StoreJob:
    def job(store: Store, _target: StoreTarget) -> tuple[dict[str, Any], int]:
        doc = entry_doc(store, resolve_entry(store, entry))
        missing = any(not o["present"] for o in doc["objects"])  # a finding in any format
        return doc, EXIT_FINDINGS if missing else EXIT_OK
    return job


@commands.command("inspect")
def inspect_cmd(
    entry: Annotated[str, typer.Argument(help="Entry id or unique prefix (>= 4 hex).")],
    root: RootOption = None,
    rank: RankOption = None,
    deployment: DeploymentOption = None,
    json_output: JsonOption = False,
) -> None:
    """Show one entry: manifest, objects, hint, supersedes, last access.

    Not found: exit 1. On a vLLM root, looks in every rank store.

    Example: [bold]spoolctl inspect 3fa9c2d1[/bold]
    """
    validate_entry_prefix(entry)
    targets = resolve_targets(root, rank=rank, deployment=deployment)
    if targets.single:
        finish(run_on_targets(targets, _inspect_job(entry), json_output=json_output,
                              view=_inspect_view, read_only_ok=True))
        return
    results = found_in(run_each(targets, _inspect_job(entry), read_only_ok=True),
                       f"no entry {entry[:64]} under {targets.given}")
    doc = multi_doc(targets, results)
    emit(doc, json_output=json_output, view=multi_view(_inspect_view))
    finish(doc["exit"])


def found_in(results: list[StoreResult], missing: str) -> list[StoreResult]:
    """The stores where an entry was found (or failed otherwise); NotFoundError if it is
    in none of them."""
    kept = [r for r in results if not r.not_found]
    if not kept:
        raise NotFoundError(missing, fix="list entries with `spoolctl ls`")
    return kept


def _inspect_view(doc: dict[str, Any]) -> list[Any]:
    from rich.json import JSON
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text
    lines = [
        f"id          {doc['entry_id']}", f"kind        {doc['kind']}",
        f"namespace   {plain(doc['namespace'])}", f"key         {plain(doc['key'][:100])}",
        f"size        {render.size(doc['size'])}", f"hint        {doc['hint']}",
        f"created     {render.past_time(doc['created'])}",
        f"last access {render.past_time(doc['last_access'])}",
        f"supersedes  {doc['supersedes'] or '-'}",
    ]
    if "expires_in_s" in doc:
        lines.append(f"expires     {render.expiry_text(doc['expires_in_s'])}")
    t = Table(title="objects", title_justify="left")
    for col in ("name", "size", "digest", "present"):
        t.add_column(col)
    for o in doc["objects"]:
        t.add_row(text(o["name"]), render.size(o["size"]), text(o["digest"]),
                  "yes" if o["present"] else "[red]MISSING[/red]")
    shown: list[Any] = [Panel(Text("\n".join(lines)), title="entry", title_align="left"), t]
    if doc["meta"]:
        # ensure_ascii: every control or non-ASCII character of client meta is a \\u escape
        shown.append(JSON.from_data(doc["meta"], ensure_ascii=True))
    return shown
