"""Store commands: ``init``, ``status``, ``ls``, ``inspect``, ``clean``, ``metrics``, ``doctor``.

Each command parses its options, calls the store library, and renders either a
rich table/panel (people) or one JSON document (``--json``, scripts). Exit
codes: 0 ok, 1 findings, 2 usage/configuration error (raised as ConfigError
and turned into one line by ``app.main``).
"""

from __future__ import annotations

import enum
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from spoolctl.store import (
    ConfigError,
    CorruptionError,
    NotFoundError,
    Store,
    parse_duration,
    parse_size,
)
from spoolctl.store.keys import validate_kind
from spoolctl.store.root import MARKER as ROOT_MARKER
from spoolctl.store.scrub import ScrubState

from . import render
from .app import app
from .common import (
    EXIT_FINDINGS,
    EXIT_OK,
    JsonOption,
    RootOption,
    console,
    emit_json,
    open_store,
    resolve_root,
)


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
    path = resolve_root(root)
    existed = (path / ".spoolctl-root").exists()
    with open_store(root, create=True, max_bytes=max_bytes) as store:
        doc = {"root": str(store.root), "store_id": store.marker.store_id,
               "max_bytes": store.max_bytes, "created": not existed}
    if json_output:
        emit_json(doc)
        return
    verb = "created" if not existed else "updated"
    console.print(Panel.fit(
        f"root      {doc['root']}\nstore id  {doc['store_id']}\n"
        f"max size  {render.size(doc['max_bytes']) if doc['max_bytes'] else 'unbounded'}",
        title=f"store {verb}"))


# -- status -----------------------------------------------------------------------------


def status_doc(store: Store) -> dict[str, Any]:
    """Everything ``status`` reports, as one JSON-ready document (catalog O(1) queries)."""
    now = time.time()
    totals = store.totals()
    by_kind = store.by_kind()
    released_n, released_b = store.released()
    items = store.quarantine_items()
    tmp_files, tmp_bytes = store.tmp_usage()
    owner = store.owner()
    max_bytes = store.max_bytes
    summary = ScrubState.summary_of(store)
    by_reason: dict[str, int] = {}
    for item in items:
        by_reason[item.reason] = by_reason.get(item.reason, 0) + 1
    genai = store.entries(kind="genai") if "genai" in by_kind else []
    expiries = [e for e in (render.expires_in(r.index, now) for r in genai) if e is not None]
    last = summary.last_cycle
    return {
        "root": str(store.root),
        "store_id": store.marker.store_id,
        "entries": totals.entries,
        "objects": totals.objects,
        "bytes": totals.bytes,
        "max_bytes": max_bytes,
        "usage_pct": round(100.0 * totals.bytes / max_bytes, 2) if max_bytes else None,
        "by_kind": by_kind,
        "released": {"entries": released_n, "bytes": released_b},
        "quarantined": {"items": len(items), "bytes": sum(i.bytes for i in items),
                        "by_reason": by_reason},
        "tmp": {"files": tmp_files, "bytes": tmp_bytes},
        "orphans": {"reclaimed_by_last_scrub": {
            "objects": last.orphan_objects if last else 0,
            "bytes": last.orphan_bytes if last else 0}},
        "genai": {"entries": len(genai), "expired": sum(1 for e in expiries if e <= 0),
                  "next_expiry_in_s": min((e for e in expiries if e > 0), default=None)},
        "scrub": summary.to_json(totals.entries),
        "owner": owner.to_json() if owner else None,
        "unknown_files": store.unknown_files,
    }


def _status_table(doc: dict[str, Any]) -> None:
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
    console.print(t)


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
    disagree (a chunk some ranks lack, or a missing rank); `--check` then exits 1.

    Example: [bold]spoolctl status --root /var/cache/spoolctl --json[/bold]
    """
    resolved = resolve_root(root)
    if _is_deployment_dir(resolved):
        _deployment_status(resolved, json_output=json_output, check=check)
        return
    with open_store(root) as store:
        doc = status_doc(store)
    if json_output:
        emit_json(doc)
    else:
        _status_table(doc)
    if check:
        last = doc["scrub"]["last_cycle"]
        over = doc["max_bytes"] is not None and doc["bytes"] > doc["max_bytes"]
        if doc["quarantined"]["items"] or over or (last and last["quarantined"]):
            raise typer.Exit(EXIT_FINDINGS)


# -- status of a vLLM deployment directory (one store per rank) -------------------------


def _rank_dirs(path: Path) -> dict[int, Path]:
    from spoolctl.connector.topology import rank_of_dirname

    if not path.is_dir() or (path / ROOT_MARKER).exists():
        return {}
    found = {}
    for child in path.iterdir():
        rank = rank_of_dirname(child.name)
        if rank is not None and child.is_dir() and not child.is_symlink():
            found[rank] = child
    return found


def _is_deployment_dir(path: Path) -> bool:
    return bool(_rank_dirs(path))


def deployment_status_doc(path: Path) -> dict[str, Any]:
    """Per-rank status of ``<root>/<deployment digest>`` and whether the ranks agree.

    Ranks agree when the rank numbering has no gaps and every rank holds the same live
    chunk keys; a chunk missing on any rank is a miss for the whole deployment.
    """
    from spoolctl.connector.topology import compare_ranks

    ranks, keys = [], {}
    for rank, rank_root in sorted(_rank_dirs(path).items()):
        with Store.open(str(rank_root)) as store:
            doc = status_doc(store)
            keys[rank] = {r.key for r in store.entries(kind="vllm")
                          if r.state == "committed" and r.hint == "retain"}
        ranks.append({"rank": rank, "root": doc["root"], "entries": doc["entries"],
                      "bytes": doc["bytes"], "max_bytes": doc["max_bytes"],
                      "chunks": len(keys[rank]), "quarantined": doc["quarantined"]["items"]})
    cmp = compare_ranks(keys)
    for row in ranks:
        row["missing_chunks"] = cmp.partial[row["rank"]]
    return {"deployment": str(path), "ranks": ranks, "agree": cmp.agree,
            "missing_ranks": list(cmp.missing_ranks), "complete_chunks": cmp.complete_keys}


def _deployment_status(path: Path, *, json_output: bool, check: bool) -> None:
    doc = deployment_status_doc(path)
    if json_output:
        emit_json(doc)
    else:
        t = Table(title=f"spoolctl status (deployment, {len(doc['ranks'])} ranks)",
                  title_justify="left")
        for col in ("rank", "chunks", "size", "quarantined", "missing chunks", "root"):
            t.add_column(col)
        for row in doc["ranks"]:
            miss = row["missing_chunks"]
            t.add_row(f"{row['rank']:04d}", str(row["chunks"]), render.size(row["bytes"]),
                      str(row["quarantined"]), f"[red]{miss}[/red]" if miss else "0",
                      escape(row["root"]))
        console.print(t)
        if doc["agree"]:
            console.print(f"ranks agree: {doc['complete_chunks']} chunks on every rank")
        else:
            gaps = ", ".join(f"{r:04d}" for r in doc["missing_ranks"])
            console.print("[red]ranks disagree[/red]: "
                          + (f"no store for rank {gaps}; " if gaps else "")
                          + f"{doc['complete_chunks']} chunks on every rank; a chunk missing "
                          "on any rank is a miss everywhere until re-stored")
    if check and (not doc["agree"] or any(r["quarantined"] for r in doc["ranks"])):
        raise typer.Exit(EXIT_FINDINGS)


# -- ls / inspect ---------------------------------------------------------------------------


def _row_json(row: Any, now: float) -> dict[str, Any]:
    doc = row.to_json()
    exp = render.expires_in(row.index, now) if row.kind == "genai" else None
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
    if json_output:
        emit_json({"entries": [_row_json(r, now) for r in rows], "count": len(rows)})
        return
    t = Table(title=f"{len(rows)} entries", title_justify="left")
    for col in ("id", "kind", "namespace", "size", "hint", "created", "last access", "expires"):
        t.add_column(col, justify="right" if col == "size" else "left",
                     no_wrap=col != "namespace", overflow="ellipsis",
                     min_width=8 if col == "namespace" else None)
    for r in rows:
        exp = render.expires_in(r.index, now) if r.kind == "genai" else None
        t.add_row(render.short_id(r.entry_id), r.kind, r.namespace[:40], render.size(r.size),
                  r.hint, render.rel_time(r.created, now), render.rel_time(r.last_access, now),
                  render.expiry_text(exp))
    console.print(t)


def resolve_entry(store: Store, text: str) -> str:
    """Resolve a user-typed id/prefix; an unknown one is a usage error (exit 2), except
    that an entry now in quarantine is a finding (exit 1) naming the item."""
    try:
        entry_id = store.resolve(text)
        if store.row(entry_id) is not None:
            return entry_id
    except NotFoundError:
        entry_id = text
    for item in store.quarantine_items():
        if item.entry_id and item.entry_id.startswith(text):
            raise CorruptionError(
                f"entry {item.entry_id[:16]} is quarantined ({item.reason})",
                reason=_reason(item.reason), path=item.path, entry_id=item.entry_id,
                fix=f"see `spoolctl quarantine show {item.item_id}`")
    raise ConfigError(f"no entry {text[:64]} in the store", path=store.root,
                      fix="list entries with `spoolctl ls`")


def _reason(value: str):
    from spoolctl.store import QuarantineReason

    try:
        return QuarantineReason(value)
    except ValueError:
        return QuarantineReason.UNKNOWN


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
        entry_id = resolve_entry(store, entry)
        row = store.row(entry_id)
        manifest = store.manifest(entry_id)  # validates; quarantines a bad one (exit 1)
        objects = []
        for ref in manifest.objects:
            path = store.layout.object_path(ref.digest)
            objects.append({**ref.to_json(), "present": path.is_file()})
    doc = {
        "entry_id": entry_id, "kind": manifest.kind, "namespace": manifest.namespace,
        "key": manifest.key, "created": manifest.created, "supersedes": manifest.supersedes,
        "hint": row.hint if row else None, "last_access": row.last_access if row else None,
        "size": row.size if row else manifest.payload_bytes, "objects": objects,
        "meta": dict(manifest.meta), "index": dict(manifest.index),
    }
    if manifest.kind == "genai":
        doc["expires_in_s"] = render.expires_in(dict(manifest.index))
    if json_output:
        emit_json(doc)
        return
    lines = [
        f"id          {entry_id}", f"kind        {manifest.kind}",
        f"namespace   {manifest.namespace}", f"key         {manifest.key[:100]}",
        f"size        {render.size(doc['size'])}", f"hint        {doc['hint']}",
        f"created     {render.rel_time(manifest.created)}",
        f"last access {render.rel_time(doc['last_access'])}",
        f"supersedes  {manifest.supersedes or '-'}",
    ]
    if "expires_in_s" in doc:
        lines.append(f"expires     {render.expiry_text(doc['expires_in_s'])}")
    console.print(Panel("\n".join(lines), title="entry", title_align="left"))
    t = Table(title="objects", title_justify="left")
    for col in ("name", "size", "digest", "present"):
        t.add_column(col)
    for o in objects:
        t.add_row(o["name"], render.size(o["size"]), o["digest"], "yes" if o["present"] else
                  "[red]MISSING[/red]")
    console.print(t)
    if manifest.meta:
        console.print_json(data=dict(manifest.meta))
    if any(not o["present"] for o in objects):
        raise typer.Exit(EXIT_FINDINGS)


# -- clean ---------------------------------------------------------------------------------


def _clean_plan(store: Store, steps: list[str], dry_run: bool, min_age: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "released" in steps:
        out["released"] = store.clean_released(dry_run=dry_run).to_json()
    if "capacity" in steps:
        out["capacity"] = store.enforce_capacity(dry_run=dry_run).to_json()
    if "tmp" in steps:
        out["tmp"] = store.clean_tmp(min_age=min_age, dry_run=dry_run).to_json()
    if "orphans" in steps:
        rep = store.collect_orphans(min_age=min_age, dry_run=dry_run)
        out["orphans"] = {**rep.orphan_objects.to_json(), "indexed": rep.indexed,
                          "dropped_rows": rep.dropped_rows, "quarantined": rep.quarantined,
                          "young_orphans": rep.young_orphans}
    return out


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
    steps = [name for name, on in (("released", released), ("capacity", capacity),
                                   ("tmp", tmp), ("orphans", orphans)) if on]
    steps = steps or ["released", "capacity", "tmp", "orphans"]
    ask = render.require_yes(yes, dry_run, "clean")
    with open_store(root) as store:
        if ask:
            plan = _clean_plan(store, steps, True, age)
            _clean_table(plan, True)
            if not typer.confirm("Delete these?", default=False):
                raise typer.Exit(EXIT_OK)
        remote = _clean_genai(store, genai, dry_run)  # before local cleanup: it settles holds
        result = _clean_plan(store, steps, dry_run, age)
    total = {k: sum(int(step.get(k, 0)) for step in result.values())
             for k in ("entries", "objects", "files", "bytes")}
    doc = {"dry_run": dry_run, "steps": result, "total": total, "genai": remote}
    if json_output:
        emit_json(doc)
    else:
        _clean_table(result, dry_run)
        for line in remote.get("lines", []):
            console.print(line, markup=False)
    if result.get("orphans", {}).get("quarantined") or remote.get("failed"):
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


def _clean_table(result: dict[str, Any], dry_run: bool) -> None:
    t = Table(title="would delete (dry run)" if dry_run else "deleted", title_justify="left")
    for col in ("step", "entries", "objects", "files", "bytes"):
        t.add_column(col, justify="left" if col == "step" else "right")
    for step, r in result.items():
        t.add_row(step, str(r.get("entries", 0)), str(r.get("objects", 0)),
                  str(r.get("files", 0)), render.size(r.get("bytes", 0)))
    console.print(t)


# -- metrics -----------------------------------------------------------------------------


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
        if not textfile.is_absolute():
            raise ConfigError("--textfile must be an absolute path", path=str(textfile),
                              fix="pass e.g. /var/lib/node_exporter/textfile/spoolctl.prom")
        if textfile.suffix != ".prom":
            raise ConfigError("--textfile must end in .prom (node_exporter ignores others)",
                              path=textfile, fix="rename it to *.prom")
        if not textfile.parent.is_dir():
            raise ConfigError("the --textfile directory does not exist", path=textfile.parent,
                              fix="create it or point --textfile elsewhere")
    with open_store(root) as store:
        text = render_store_metrics(store)
    if textfile is None:
        typer.echo(text, nl=False)
        return
    _write_atomic(textfile, text.encode())


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a same-directory temp file + rename, so a reader
    (node_exporter) never sees a partial file."""
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
        from contextlib import suppress

        with suppress(OSError):
            os.unlink(tmp)
        raise ConfigError(f"cannot write the metrics file: {os.strerror(exc.errno or 0)}",
                          path=path, fix="check the directory's permissions") from None


# -- doctor --------------------------------------------------------------------------------


@app.command("doctor")
def doctor_cmd(root: RootOption = None, json_output: JsonOption = False) -> None:
    """Check the root, the filesystem and SQLite health; print what to fix.

    Root: marker, permissions, owner. Filesystem: type, free space vs max size, O_DIRECT,
    fsync. Exit 1 when a check fails.

    Example: [bold]spoolctl doctor --root /var/cache/spoolctl[/bold]
    """
    from spoolctl.store.doctor import run_checks

    checks = run_checks(resolve_root(root))
    failed = any(c.status == "fail" for c in checks)
    if json_output:
        emit_json({"root": str(resolve_root(root)), "ok": not failed,
                   "checks": [c.to_json() for c in checks]})
    else:
        t = Table(title=f"doctor {resolve_root(root)}", title_justify="left")
        for col in ("check", "status", "detail", "fix"):
            t.add_column(col)
        colors = {"ok": "green", "warn": "yellow", "fail": "red"}
        for c in checks:
            t.add_row(c.name, f"[{colors[c.status]}]{c.status}[/{colors[c.status]}]", c.detail,
                      c.fix)
        console.print(t)
    if failed:
        raise typer.Exit(EXIT_FINDINGS)
