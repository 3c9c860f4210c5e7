"""Looking at a store: ``init``, ``status``, ``ls``, ``inspect``.

Each command parses its options, asks the store (or the deployment's rank stores, see
``targets``) for one document, and ``emit``s it: a rich view for people, JSON for
scripts (``--json``). Exit codes: 0 ok, 1 findings, 2 usage/configuration error (raised
as ConfigError and turned into one line by ``app.main``).
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.json import JSON
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from spoolctl.store import CatalogRow, Store, StoreFacts, parse_size
from spoolctl.store.keys import validate_kind
from spoolctl.store.root import MARKER

from . import render
from .app import app
from .common import EXIT_FINDINGS, JsonOption, RootOption, emit, open_store, resolve_root
from .targets import Targets, resolve_entry, resolve_targets

if TYPE_CHECKING:
    from spoolctl.connector.topology import DeploymentStatus


class HintChoice(str, enum.Enum):
    retain = "retain"
    release = "release"


class SortChoice(str, enum.Enum):
    size = "size"
    age = "age"
    access = "access"


# -- init -----------------------------------------------------------------------------


@app.command("init")
def init_cmd(
    root: RootOption = None,
    max_size: Annotated[str | None, typer.Option(
        "--max-size", help="Maximum store size: 200GiB, 512MiB, 10GB or plain bytes.")] = None,
    json_output: JsonOption = False,
) -> None:
    """Create a store (or update the max size of an existing one).

    Example: [bold]spoolctl init --root /var/cache/spoolctl --max-size 200GiB[/bold]
    """
    max_bytes = parse_size(max_size) if max_size is not None else None
    existed = (resolve_root(root) / MARKER).exists()
    with open_store(root, create=True, max_bytes=max_bytes) as store:
        doc = {"root": str(store.root), "store_id": store.marker.store_id,
               "max_bytes": store.max_bytes, "created": not existed}
    emit(doc, json_output=json_output, view=_init_view)


def _init_view(doc: dict[str, Any]) -> Panel:
    size = render.size(doc["max_bytes"]) if doc["max_bytes"] else "unbounded"
    return Panel.fit(f"root      {doc['root']}\nstore id  {doc['store_id']}\n"
                     f"max size  {size}",
                     title=f"store {'created' if doc['created'] else 'updated'}")


# -- status -----------------------------------------------------------------------------


def status_doc(store: Store, facts: StoreFacts | None = None) -> dict[str, Any]:
    """Everything ``status`` reports for one store: its facts snapshot (``Store.facts``)
    plus the expiry of its GenAI records."""
    from spoolctl.controllers.genai_records import expiry_summary

    facts = facts if facts is not None else store.facts()
    genai = store.entries(kind="genai") if "genai" in facts.by_kind else []
    return {**facts.to_json(), "genai": expiry_summary(genai, time.time()).to_json()}


@app.command("status")
def status(
    root: RootOption = None,
    json_output: JsonOption = False,
    check: Annotated[bool, typer.Option(
        "--check", help="Exit 1 if anything needs attention: quarantined items, "
        "over max size, or findings in the last scrub.")] = False,
) -> None:
    """Show the store's entries, usage, backlog, quarantine, scrub state and owner.

    Entries and bytes in total and by kind, max size and usage, released entries waiting
    for cleanup, quarantined items, temp files, the last and current scrub cycle, and the
    owner lease holder.

    Given a vLLM deployment directory (`<root>/<deployment digest>`, holding one
    `rank-NNNN` store per rank), summarises every rank on this host and flags ranks that
    disagree (a chunk some ranks lack, or a missing rank); `--check` then exits 1. It also
    shows the host total against the deployment's host disk budget, if one is set.

    Example: [bold]spoolctl status --root /var/cache/spoolctl --json[/bold]
    """
    targets = resolve_targets(root)
    if targets.kind == "deployment":
        deployment = deployment_status_of(targets)
        emit(deployment.to_json(), json_output=json_output, view=_deployment_view)
        findings = deployment.has_findings
    else:
        with open_store(targets.given) as store:
            facts = store.facts()
            doc = status_doc(store, facts)
        emit(doc, json_output=json_output, view=_status_view)
        findings = facts.needs_attention
    if check and findings:
        raise typer.Exit(EXIT_FINDINGS)


def _status_view(doc: dict[str, Any]) -> Table:
    t = Table(title="spoolctl status", show_header=False, title_justify="left")
    t.add_column("what", style="bold", no_wrap=True)
    t.add_column("value")
    t.add_row("root", doc["root"])
    usage = f" ({doc['usage_pct']:.1f}% of {render.size(doc['max_bytes'])})" \
        if doc["max_bytes"] else " (no max size)"
    t.add_row("entries", f"{doc['entries']}  {render.size(doc['bytes'])}{usage}")
    for kind, slot in sorted(doc["by_kind"].items()):
        t.add_row(f"  {kind}", f"{slot['entries']}  {render.size(slot['bytes'])}"
                  f"  ({slot['released']} released)")
    t.add_row("released", f"{doc['released']['entries']} waiting for cleanup  "
              f"{render.size(doc['released']['bytes'])}")
    q = doc["quarantined"]
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(q["by_reason"].items()))
    text = f"{q['items']} items  {render.size(q['bytes'])}" + (f"  ({reasons})" if reasons else "")
    t.add_row("quarantined", f"[red]{text}[/red]" if q["items"] else text)
    t.add_row("temp files", f"{doc['tmp']['files']}  {render.size(doc['tmp']['bytes'])}")
    if doc["genai"]["entries"]:
        nxt = doc["genai"]["next_expiry_in_s"]
        t.add_row("genai caches", f"{doc['genai']['entries']} ({doc['genai']['expired']} expired"
                  f"{', next expiry ' + render.expiry_text(nxt) if nxt else ''})")
    scrub = doc["scrub"]
    last = scrub["last_cycle"]
    if last:
        t.add_row("last scrub", f"finished {render.rel_time(last['finished'])}: "
                  f"{last['checked']} entries / {render.size(last['bytes'])} authenticated, "
                  f"{last['quarantined']} quarantined, "
                  f"{render.size(last['orphan_bytes'])} orphans reclaimed")
    else:
        t.add_row("last scrub", "never completed")
    cur = scrub["current"]
    if cur:
        t.add_row("scrub progress", f"{100 * cur['progress']:.1f}% (cycle started "
                  f"{render.rel_time(cur['started'])}, updated {render.rel_time(cur['updated'])})")
    owner = doc["owner"]
    t.add_row("owner", f"{owner['role']} pid {owner['pid']} on {owner['host']} since "
              f"{render.rel_time(owner['since'])}" if owner else "none")
    if doc["unknown_files"]:
        t.add_row("unknown files", ", ".join(doc["unknown_files"][:5]))
    return t


def deployment_status_of(targets: Targets) -> DeploymentStatus:
    """Per-rank status of a deployment directory (``connector.topology.deployment_status``)."""
    from spoolctl.connector import host_budget
    from spoolctl.connector.topology import RankReport, deployment_status

    reports = []
    for target in targets.stores:
        with Store.open(str(target.root)) as store:
            facts = store.facts()
            keys = frozenset(r.key for r in store.entries(kind="vllm") if r.hint == "retain")
        assert target.rank is not None
        reports.append(RankReport(
            rank=target.rank, root=facts.root, entries=facts.totals.entries,
            bytes=facts.totals.bytes, max_bytes=facts.max_bytes,
            quarantined=facts.quarantine.items, chunk_keys=keys))
    # Issue 20 (host disk budget): the budget the deployment's workers recorded.
    budget, error = None, None
    try:
        budget = host_budget.read(targets.given)
    except host_budget.HostBudgetError as exc:
        error = str(exc)
    return deployment_status(str(targets.given), reports, host_max_bytes=budget,
                             host_budget_error=error)


def _deployment_view(doc: dict[str, Any]) -> list[Any]:
    t = Table(title=f"spoolctl status (deployment, {len(doc['ranks'])} ranks)",
              title_justify="left")
    for col in ("rank", "chunks", "size", "quarantined", "missing chunks", "root"):
        t.add_column(col)
    for row in doc["ranks"]:
        miss = row["missing_chunks"]
        t.add_row(f"{row['rank']:04d}", str(row["chunks"]), render.size(row["bytes"]),
                  str(row["quarantined"]), f"[red]{miss}[/red]" if miss else "0",
                  escape(row["root"]))
    if doc["agree"]:
        verdict = f"ranks agree: {doc['complete_chunks']} chunks on every rank"
    else:
        gaps = ", ".join(f"{r:04d}" for r in doc["missing_ranks"])
        verdict = ("[red]ranks disagree[/red]: "
                   + (f"no store for rank {gaps}; " if gaps else "")
                   + f"{doc['complete_chunks']} chunks on every rank; a chunk missing "
                   "on any rank is a miss everywhere until re-stored")
    return [t, verdict, _host_line(doc["host"])]


def _host_line(host: dict[str, Any]) -> Text:
    """Issue 20: the host total against the host disk budget."""
    total = render.size(host["bytes"])
    if host.get("error"):
        return Text(f"host total {total}; host budget record unreadable: {host['error']}")
    if not host["max_bytes"]:
        return Text(f"host total {total} (no host budget)")
    return Text(f"host total {total} of {render.size(host['max_bytes'])} host budget "
                f"({host['usage_pct']:.1f}%)")


# -- ls / inspect ---------------------------------------------------------------------------


def _row_json(row: CatalogRow, now: float) -> dict[str, Any]:
    from spoolctl.controllers.genai_records import expires_in

    doc = row.to_json()
    exp = expires_in(row.index, now) if row.kind == "genai" else None
    if exp is not None:
        doc["expires_in_s"] = round(exp, 1)
        doc["name"] = row.index.get("name")
    return doc


@app.command("ls")
def ls_cmd(
    root: RootOption = None,
    kind: Annotated[str | None, typer.Option("--kind", help="vllm, pytorch, mlx or genai.")] = None,
    hint: Annotated[HintChoice | None, typer.Option("--hint", help="retain or release.")] = None,
    sort: Annotated[SortChoice, typer.Option("--sort", help="size, age or access.")] =
        SortChoice.access,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Show at most N.")] = None,
    json_output: JsonOption = False,
) -> None:
    """List entries (newest access first by default).

    Example: [bold]spoolctl ls --kind vllm --hint release --sort size --limit 20[/bold]
    """
    if kind is not None:
        validate_kind(kind)
    with open_store(root) as store:
        rows = store.entries(kind=kind, hint=hint.value if hint else None, sort=sort.value,
                             limit=limit)
    now = time.time()
    emit({"entries": [_row_json(r, now) for r in rows], "count": len(rows)},
         json_output=json_output, view=_ls_view)


def _ls_view(doc: dict[str, Any]) -> Table:
    now = time.time()
    t = Table(title=f"{doc['count']} entries", title_justify="left")
    for col in ("id", "kind", "namespace", "size", "hint", "created", "last access", "expires"):
        t.add_column(col, justify="right" if col == "size" else "left",
                     no_wrap=col != "namespace", overflow="ellipsis",
                     min_width=8 if col == "namespace" else None)
    for r in doc["entries"]:
        t.add_row(render.short_id(r["entry_id"]), r["kind"], r["namespace"][:40],
                  render.size(r["size"]), r["hint"], render.rel_time(r["created"], now),
                  render.rel_time(r["last_access"], now),
                  render.expiry_text(r.get("expires_in_s")))
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
        "size": row.size if row else manifest.payload_bytes, "objects": objects,
        "meta": dict(manifest.meta), "index": dict(manifest.index),
    }
    if manifest.kind == "genai":
        from spoolctl.controllers.genai_records import expires_in

        doc["expires_in_s"] = expires_in(dict(manifest.index), time.time())
    return doc


@app.command("inspect")
def inspect_cmd(
    entry: Annotated[str, typer.Argument(help="Entry id or unique prefix (>= 4 hex).")],
    root: RootOption = None,
    json_output: JsonOption = False,
) -> None:
    """Show one entry: manifest, objects, hint, supersedes, last access.

    Example: [bold]spoolctl inspect 3fa9c2d1[/bold]
    """
    with open_store(root) as store:
        doc = entry_doc(store, resolve_entry(store, entry))
    emit(doc, json_output=json_output, view=_inspect_view)
    if any(not o["present"] for o in doc["objects"]):  # a finding, whatever the output
        raise typer.Exit(EXIT_FINDINGS)


def _inspect_view(doc: dict[str, Any]) -> list[Any]:
    lines = [
        f"id          {doc['entry_id']}", f"kind        {doc['kind']}",
        f"namespace   {doc['namespace']}", f"key         {doc['key'][:100]}",
        f"size        {render.size(doc['size'])}", f"hint        {doc['hint']}",
        f"created     {render.rel_time(doc['created'])}",
        f"last access {render.rel_time(doc['last_access'])}",
        f"supersedes  {doc['supersedes'] or '-'}",
    ]
    if "expires_in_s" in doc:
        lines.append(f"expires     {render.expiry_text(doc['expires_in_s'])}")
    t = Table(title="objects", title_justify="left")
    for col in ("name", "size", "digest", "present"):
        t.add_column(col)
    for o in doc["objects"]:
        t.add_row(o["name"], render.size(o["size"]), o["digest"],
                  "yes" if o["present"] else "[red]MISSING[/red]")
    shown: list[Any] = [Panel("\n".join(lines), title="entry", title_align="left"), t]
    if doc["meta"]:
        shown.append(JSON.from_data(doc["meta"]))
    return shown
