"""Setting up and looking at stores: ``init`` and ``status``.

Each command parses its options, resolves ``--root`` into stores (``targets``: one store,
a vLLM deployment directory or a base root), asks each store for one document and
``emit``s it: a rich view for people, JSON for scripts (``--json``). Exit codes: 0 ok,
1 findings, 2 usage/configuration error (raised as ConfigError and turned into one line
by ``app.main``); on several stores, the worst of them (``fanout``).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from spoolctl.store import parse_size

from . import render
from .common import (
    EXIT_FINDINGS,
    EXIT_OK,
    DeploymentOption,
    JsonOption,
    RankOption,
    RootOption,
    RootsOption,
    drive_roots,
    emit,
    esc,
    first_root,
    open_store,
    plain,
    text,
)
from .disk_deadline import within_disk_timeout
from .fanout import finish, multi_doc, run_each, run_on_targets, run_per_drive, worst
from .targets import StoreTarget, Targets, resolve_targets, targets_from_json, targets_json

# This module's commands: cli/commands.py adds them to the spoolctl app (the one place
# that lists every command).
commands = typer.Typer()

if TYPE_CHECKING:
    from rich.table import Table
    from rich.text import Text

    from spoolctl.connector.deployment.topology import DeploymentStatus
    from spoolctl.store import Store, StoreFacts


# -- init -----------------------------------------------------------------------------


def _init_job(max_bytes: int | None):
    def job(store: Store, _target: StoreTarget) -> tuple[dict[str, Any], int]:
        before = store.max_bytes
        if max_bytes is not None and max_bytes != before:
            store.set_max_bytes(max_bytes)  # works on a full disk (the reserve)
        used = store.totals().bytes
        return {"root": str(store.root), "store_id": store.marker.store_id,
                "max_bytes": store.max_bytes, "created": False,
                "changed": store.max_bytes != before, "default_max_bytes": False,
                "previous_max_bytes": before, "bytes": used,
                "over_max": store.max_bytes is not None and used > store.max_bytes}, EXIT_OK
    return job


@commands.command("init")
def init_cmd(
    root: RootOption = None,
    max_size: Annotated[str | None, typer.Option(
        "--max-size", help="Maximum store size: 200GiB, 512MiB, 10GB or plain bytes.")] = None,
    rank: RankOption = None,
    deployment: DeploymentOption = None,
    json_output: JsonOption = False,
) -> None:
    """Create a store (or update the max size of an existing one).

    A new store without `--max-size` is bounded by the default the controllers use: a
    tenth of its filesystem, at most 64 GiB, at least 1 GiB. An existing store keeps its
    max size unless `--max-size` is given ("nothing changed" otherwise).

    On a vLLM base root or deployment directory, updates the max size of every rank store
    (the connector sets it again from its own config at its next start). Lowering the max
    size works on a full disk; `spoolctl clean --capacity` then evicts down to it.

    Example: [bold]spoolctl init --root /var/cache/spoolctl --max-size 200GiB[/bold]
    """
    from spoolctl.store import MARKER
    max_bytes = parse_size(max_size) if max_size is not None else None
    targets = resolve_targets(root, rank=rank, deployment=deployment)
    if targets.kind in ("store", "empty"):
        path = targets.given
        existed = (path / MARKER).exists()
        if existed:
            code = run_on_targets(Targets(path, "store", (StoreTarget(path),)),
                                  _init_job(max_bytes), json_output=json_output,
                                  view=_init_view)
            finish(code)
            return
        from spoolctl.controllers.local.engine import default_max_bytes

        limit = max_bytes if max_bytes is not None else default_max_bytes(path)
        with open_store(path, create=True, max_bytes=limit) as store:
            doc = {"root": str(store.root), "store_id": store.marker.store_id,
                   "max_bytes": store.max_bytes, "created": True, "changed": True,
                   "default_max_bytes": max_bytes is None, "previous_max_bytes": None,
                   "bytes": 0, "over_max": False}
        emit(doc, json_output=json_output, view=_init_view)
        return
    finish(run_on_targets(targets, _init_job(max_bytes), json_output=json_output,
                          view=_init_view))


def _init_view(doc: dict[str, Any]) -> list[Any]:
    from rich.panel import Panel
    from rich.text import Text
    size = render.size(doc["max_bytes"]) if doc["max_bytes"] else "unbounded"
    if doc.get("default_max_bytes"):
        size += " (default: a tenth of the filesystem, at most 64 GiB; --max-size to choose)"
    title = "store created" if doc["created"] else \
        "store updated" if doc.get("changed", True) else "store unchanged"
    shown: list[Any] = [Panel.fit(
        Text(f"root      {plain(doc['root'])}\nstore id  {plain(doc['store_id'])}\n"
             f"max size  {size}"), title=title)]
    if not doc["created"] and not doc.get("changed", True):
        shown.append(Text("nothing changed (give --max-size to change the max size)"
                          if doc["max_bytes"] else "nothing changed: the store is unbounded; "
                          "give --max-size to bound it", style="yellow"))
    if doc.get("over_max"):
        shown.append(Text(f"the store holds {render.size(doc['bytes'])}, over its max size: "
                          "`spoolctl clean --capacity --yes` evicts down to 90% of it (the "
                          "cron cleaner does it at its next run)", style="yellow"))
    return shown


# -- status -----------------------------------------------------------------------------


def status_doc(store: Store, facts: StoreFacts | None = None) -> dict[str, Any]:
    """Everything ``status`` reports for one store: its facts snapshot (``Store.facts``)
    plus the expiry of its GenAI records."""
    from spoolctl.controllers.genai.records import expiry_summary

    facts = facts if facts is not None else store.facts()
    genai = store.entries(kind="genai") if "genai" in facts.by_kind else []
    doc = {**facts.to_json(), "genai": expiry_summary(genai, time.time()).to_json()}
    if (out := out_of_service_doc(store.root)) is not None:
        doc["out_of_service"] = out
    return doc


def out_of_service_doc(store_root: Path) -> dict[str, Any] | None:
    """The record a vLLM worker keeps beside its rank store while its guard has that store
    out of service (``connector/deployment/out_of_service.py``), None without one;
    ``{"error": ...}`` when it cannot be read."""
    from spoolctl.connector.deployment import out_of_service

    try:
        return out_of_service.read(store_root)
    except out_of_service.DescriptionError as exc:
        return {"error": str(exc)}


def out_of_service_line(name: str, out: dict[str, Any]) -> Text:
    """One line saying that ``name`` (a store, a rank) is out of service for its engine."""
    from rich.text import Text
    if "error" in out:
        return Text(f"{name}: out-of-service record unreadable: {plain(out['error'])}",
                    style="yellow")
    who = f"pid {out['pid']} on {plain(out['host'])}"
    if out["stale"]:
        return Text(f"{name}: a stale out-of-service record (its engine, {who}, is gone; "
                    f"it said since {render.past_time(out['since'], time.time())}: "
                    f"{plain(out['reason'])}); the next engine start removes it",
                    style="yellow")
    return Text(f"{name}: taken out of service by its engine ({who}) "
                f"{render.past_time(out['since'], time.time())}: {plain(out['reason'])}; "
                "lookups and restores skip it and its writes go to the other drives until "
                "the engine's probe reads it again", style="red")


@commands.command("status")
def status(
    root: RootsOption = None,
    json_output: JsonOption = False,
    check: Annotated[bool, typer.Option(
        "--check", help="Exit 1 if anything needs attention: quarantined items, "
        "over max size, findings in the last scrub, malformed catalog rows or GenAI "
        "records.")] = False,
    rank: RankOption = None,
    deployment: DeploymentOption = None,
) -> None:
    """Show the store's entries, usage, backlog, quarantine, scrub state and owner.

    Entries and bytes in total and by kind, max size and usage, released entries waiting
    for cleanup, quarantined items, temp files, the last and current scrub cycle, and the
    owner lease holder.

    Given a vLLM base root (the root of `spoolctl config vllm`) or one deployment
    directory under it, summarises every rank store on this host and flags ranks that
    disagree (a chunk some ranks lack, or a missing rank); `--check` then exits 1. It also
    shows each deployment's host total against its host disk budget, if one is set.

    Example: [bold]spoolctl status --root /var/cache/spoolctl --json[/bold]
    """
    drives = drive_roots(root)
    if drives is not None:  # several drives: a row each, and totals (decision 2712)
        finish(run_per_drive(drives, lambda one: _status_of(one, rank, deployment, check),
                             json_output=json_output, totals=_status_totals))
        return
    doc, code, view = _status_of(first_root(root), rank, deployment, check)
    emit(doc, json_output=json_output, view=view)
    finish(code)


def _status_of(root: Path | None, rank: int | None, deployment: str | None,
               check: bool) -> tuple[dict[str, Any], int, Any]:
    """``status`` of one root: its document, exit code and view."""
    targets = targets_from_json(within_disk_timeout(root or "SPOOLCTL_ROOT", lambda: (
        targets_json(resolve_targets(root, rank=rank, deployment=deployment)))))
    if targets.single:
        def read() -> tuple[dict[str, Any], bool]:
            from spoolctl.store import encryption_summary

            with open_store(targets.given, read_only_ok=True) as store:
                facts = store.facts()
                doc = status_doc(store, facts)
                doc["models"] = models_doc(store)
                if (encryption := encryption_summary(store)) is not None:
                    doc["encryption"] = encryption
            return doc, facts.needs_attention

        # a hung disk: reported down
        doc, needs_attention = within_disk_timeout(targets.given, read)
        attention = needs_attention or bool(doc["genai"]["malformed"])
        return doc, EXIT_FINDINGS if check and attention else EXIT_OK, _status_view
    doc, findings = deployment_status_doc(targets)
    errors = worst([s["exit"] for s in doc["stores"] if "error" in s])
    return doc, errors or (EXIT_FINDINGS if check and findings else EXIT_OK), _deployment_view


def _status_totals(doc: dict[str, Any]) -> dict[str, int]:
    """One store's entries and bytes (a rank store's are under ``status``)."""
    facts = doc.get("status", doc)
    return {"stores": 1, "entries": int(facts.get("entries") or 0),
            "bytes": int(facts.get("bytes") or 0)}


def models_doc(store: Store) -> dict[str, Any]:
    """``models`` of ``status --json``: each controller model namespace of the store with its
    last use, bytes and lifecycle verdict (decision 2120)."""
    from .lifecycle import model_json, model_uses, model_verdicts

    uses = model_uses(store)
    judged = model_verdicts(uses)
    return {name: model_json(uses[name], judged[name]) for name in sorted(uses)}


def _model_lines(models: dict[str, Any]) -> list[Text]:
    """One line per controller model, below the table (wrapped, never cut): what it is, its
    last use and size, and whether a newer generation replaced it."""
    from rich.text import Text
    out, now = [], time.time()
    for name, m in models.items():
        # hour granularity: the lifecycle rules work in days, and the view stays the same
        # from one run to the next (`spoolctl` and `spoolctl status` show one view)
        last = m.get("last_used")
        used = "never" if not last else render.past_time(last, now) \
            if abs(now - last) >= 3600 else "within the last hour"
        line = Text(f"model {plain(name)}: {_model_identity(m)}; last used {used}; "
                    f"{m['entries']} entries, {render.size(m['bytes'])}")
        if m["state"] != "current":
            line.append(f"\n  {m['state']} ({m['reason']}): nothing will read it again; "
                        "`spoolctl clean --superseded --yes` reclaims it", style="yellow")
        out.append(line)
    return out


def _model_identity(m: dict[str, Any]) -> str:
    """What a controller namespace holds (model, framework, weights), each part that its
    entries do not record said to be unknown, and why, never a bare ``?`` or ``None``."""
    model, framework, weights = m.get("model"), m.get("framework"), m.get("weights")
    if not (model or framework or weights):
        return "unknown (its entries record no model, framework or weights)"
    return (f"{plain(str(model)) if model else 'unknown model'} "
            f"({plain(str(framework)) if framework else 'framework unknown'}, weights "
            f"{plain(str(weights)[:24]) if weights else 'not recorded'})")


def _status_view(doc: dict[str, Any]) -> Table | list[Any]:
    from rich.table import Table
    from rich.text import Text
    t = Table(title="spoolctl status" + (" (read-only view)" if doc.get("read_only") else ""),
              show_header=False, title_justify="left")
    t.add_column("what", style="bold", no_wrap=True)
    t.add_column("value")
    t.add_row("root", text(doc["root"]))
    usage = f" ({doc['usage_pct']:.1f}% of {render.size(doc['max_bytes'])})" \
        if doc["max_bytes"] else " (unbounded)"  # one word for it, as `init` says
    t.add_row("entries", f"{doc['entries']}  {render.size(doc['bytes'])}{usage}")
    for kind, slot in sorted(doc["by_kind"].items()):
        t.add_row(text(f"  {kind}"), f"{slot['entries']}  {render.size(slot['bytes'])}"
                  f"  ({slot['released']} released)")
    t.add_row("released", f"{doc['released']['entries']} waiting for cleanup  "
              f"{render.size(doc['released']['bytes'])}")
    if (enc := doc.get("encryption")) is not None:
        mk = enc["master_key"]
        key = "no master key configured: encrypted entries are misses" if mk is None else \
            f"master key {mk['key_id']}" + ("" if mk["matches_keyring"] else " (NOT this "
                                           "store's: encrypted entries are misses)")
        by = ", ".join(f"v{v} {n}" for v, n in sorted(enc["entries_by_version"].items()))
        imported = ", ".join(f"{tid}: " + ", ".join(f"v{v}" for v in vs)
                             for tid, vs in sorted(enc.get("imported_keys", {}).items()))
        t.add_row("encryption", f"{key}; {enc['tenants']} tenants; entries by key version: "
                  f"{by or 'none'}; {enc['unreadable_entries']} unreadable"
                  + (f"; imported keys: {imported}" if imported else ""))
    q = doc["quarantined"]
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(q["by_reason"].items()))
    shown = f"{q['items']} items  {render.size(q['bytes'])}" + (f"  ({reasons})" if reasons else "")
    t.add_row("quarantined", text(shown, "red" if q["items"] else None))
    tmp = doc["tmp"]
    if tmp.get("at_least"):  # a listing bounded on purpose: the disk answered, tmp/ is huge
        t.add_row("temp files", Text(
            f"at least {tmp['files']} (counting stopped there)  {render.size(tmp['bytes'])}+: "
            "abandoned writes fill tmp/; `spoolctl clean --tmp --yes` reclaims them",
            style="yellow"))
    else:
        t.add_row("temp files", f"{tmp['files']}  {render.size(tmp['bytes'])}")
    if doc.get("malformed_rows"):
        t.add_row("malformed rows", Text(f"{doc['malformed_rows']} skipped by clean and status "
                                         "(`spoolctl doctor`)", style="red"))
    if doc["genai"]["entries"]:
        nxt = doc["genai"]["next_expiry_in_s"]
        t.add_row("genai caches", f"{doc['genai']['entries']} ({doc['genai']['expired']} expired"
                  f"{', next expiry ' + render.expiry_text(nxt) if nxt else ''})")
    if doc["genai"].get("malformed"):
        t.add_row("malformed genai", Text(f"{doc['genai']['malformed']} record(s) the GenAI "
                                          "helpers skip (`spoolctl doctor`)", style="red"))
    scrub = doc["scrub"]
    last = scrub["last_cycle"]
    if last:
        t.add_row("last scrub", f"finished {render.past_time(last['finished'])}: "
                  f"{last['checked']} entries / {render.size(last['bytes'])} checked, "
                  f"{last['quarantined']} quarantined, "
                  f"{render.size(last['orphan_bytes'])} orphans reclaimed")
    else:
        t.add_row("last scrub", "never completed")
    cur = scrub["current"]
    if cur:
        t.add_row("scrub progress", f"{100 * cur['progress']:.1f}% (cycle started "
                  f"{render.past_time(cur['started'])}, updated "
                  f"{render.past_time(cur['updated'])})")
    if doc.get("scrub_unreadable"):
        t.add_row("unreadable", Text(f"{doc['scrub_unreadable']} entries the scrub could not "
                                     "read (`spoolctl doctor`)", style="red"))
    owner = doc["owner"]
    t.add_row("owner", text(f"{owner['role']} pid {owner['pid']} on {owner['host']} since "
                            f"{render.past_time(owner['since'])}") if owner else "none")
    if doc["unknown_files"]:
        t.add_row("unknown files", text(", ".join(doc["unknown_files"][:5])))
    models = doc.get("models") or {}
    out = [*_model_lines(models)]
    if (off := doc.get("out_of_service")) is not None:
        out.insert(0, out_of_service_line("this store", off))
    return [t, *out] if out else t


def deployment_status_doc(targets: Targets) -> tuple[dict[str, Any], bool]:
    """Per-rank status of a deployment directory or base root, and whether anything needs
    attention (ranks that disagree, quarantine, a rank's own findings)."""
    if not targets.stores:  # an empty root: nothing to read, nor anything to load for it
        return multi_doc(targets, [], deployments={}), False
    from spoolctl.connector.deployment.topology import RankReport
    from spoolctl.store import DeploymentUse

    from .lifecycle import deployment_uses, lifecycle_json, rank_use, siblings, verdicts

    def job(store: Store, target: StoreTarget) -> tuple[dict[str, Any], int]:
        facts = store.facts()
        rows = store.entries(kind="vllm")
        keys = frozenset(r.key for r in rows if r.hint == "retain")
        assert target.rank is not None
        report = RankReport(rank=target.rank, root=facts.root, entries=facts.totals.entries,
                            bytes=facts.totals.bytes, max_bytes=facts.max_bytes,
                            quarantined=facts.quarantine.items, chunk_keys=keys,
                            write_budget=_write_budget(store.root))
        # JSON from a bounded child (``disk_deadline``): the parent rebuilds both
        return {"status": status_doc(store, facts), "_report": report.to_json_doc(),
                "_use": asdict(rank_use(store, target.deployment or "", rows)),
                "attention": facts.needs_attention}, EXIT_OK

    results = run_each(targets, job, read_only_ok=True, bounded=True)
    groups: dict[str, list[Any]] = {}
    failed: dict[str, list[int]] = {}
    used: dict[str, list[DeploymentUse]] = {}
    for r in results:
        if r.doc is None and r.target.rank is not None:
            groups.setdefault(r.target.deployment or "", [])
            failed.setdefault(r.target.deployment or "", []).append(r.target.rank)
        if r.doc is not None:
            groups.setdefault(r.target.deployment or "", []).append(
                RankReport.from_json_doc(r.doc.pop("_report")))
            used.setdefault(r.target.deployment or "", []).append(
                DeploymentUse(**r.doc.pop("_use")))
    deployments = {name: _deployment_status(str(_dep_dir(targets, name)), reports,
                                            failed.get(name, []))
                   for name, reports in groups.items()}
    findings = any(d.has_findings for d in deployments.values()) or any(
        r.doc is not None and r.doc["attention"] for r in results)
    # Which deployments no longer match anything current (decision 2112).
    # Every deployment shown, also one none of whose ranks could be read (all down).
    uses = {name: DeploymentUse.merge(name, used.get(name, [])) for name in groups}
    everyone = siblings(targets)
    if len(everyone.stores) != len(targets.stores) or everyone.given != targets.given:
        uses = {**uses, **deployment_uses(everyone)}  # narrowed: a successor is a sibling
    judged = verdicts(uses)
    extra: dict[str, Any] = {"deployments": {
        n: {**d.to_json(), "lifecycle": lifecycle_json(uses[n], judged[n]),
            **_description(_dep_dir(targets, n)), **_usage(_dep_dir(targets, n))}
        for n, d in deployments.items()}}
    if targets.kind == "deployment" and len(deployments) == 1:
        # the shape scripts of one deployment directory read (ranks, agree, ...)
        extra.update(next(iter(deployments.values())).to_json())
    return multi_doc(targets, results, **extra), findings


def _write_budget(store_root: Path) -> dict[str, Any] | None:
    """The rank store's write budget today (its ledger beside it, decision 2710), None
    without one, ``{"error": ...}`` when the ledger cannot be read."""
    from spoolctl.connector.deployment import write_budget

    try:
        state = write_budget.read(write_budget.ledger_path(store_root))
    except write_budget.LedgerError as exc:
        return {"error": str(exc)}
    return state.to_json(time.time()) if state is not None else None


def _budget_cell(budget: dict[str, Any] | None) -> Text:
    from rich.text import Text
    if budget is None:
        return Text("no budget")
    if "error" in budget:
        return Text(f"error: {plain(budget['error'])}", style="red")
    cell = Text(f"{render.size(budget['used_bytes'])} of {render.size(budget['budget_bytes'])}")
    if budget["left_pct"] <= 0:
        cell.append(" (spent: no writes until 00:00 UTC)", style="yellow")
    return cell


def _description(where: Path) -> dict[str, Any]:
    """``description``: what the deployment is (its ``deployment.json``: model, dtypes,
    TP/PP), None before its workers wrote one; ``description_error`` when unreadable."""
    from spoolctl.connector.deployment import description

    try:
        return {"description": description.read(where)}
    except description.DescriptionError as exc:
        return {"description": None, "description_error": str(exc)}


def _usage(where: Path) -> dict[str, Any]:
    """``usage``: the hit rate the deployment's engine counted since it started (its
    ``usage.json``), None before its first lookup; ``usage_error`` when unreadable."""
    from spoolctl.connector.deployment import description, usage_record

    try:
        usage = usage_record.read(where)
    except description.DescriptionError as exc:
        return {"usage": None, "usage_error": str(exc)}
    return {"usage": usage.to_json() if usage is not None else None}


def _hit_rate_line(dep: dict[str, Any]) -> Text:
    """The engine's hit rate from ``usage.json``; where to read it while there is none."""
    from rich.text import Text
    usage = dep.get("usage")
    if dep.get("usage_error"):
        return Text(f"hit rate: {plain(dep['usage_error'])}", style="yellow")
    if not usage or usage.get("hit_rate") is None:
        return Text("hit rate: no lookup recorded yet (the engine writes usage.json within "
                    "5 s of its first requests; live: spoolctl_hit_tokens_total / "
                    "spoolctl_lookup_tokens_total on vLLM's /metrics)")
    now = time.time()
    return Text(f"hit rate: {100 * usage['hit_rate']:.1f}% of prompt tokens "
                f"({usage['hit_tokens']:,} of {usage['lookup_tokens']:,} restored; "
                f"{usage['hits']:,} of {usage['lookups']:,} requests hit) since the engine "
                f"started {render.past_time(usage['since'], now)}, updated "
                f"{render.past_time(usage['updated'], now)}")


def _dep_dir(targets: Targets, name: str):
    return targets.given if targets.kind == "deployment" else targets.given / name


def _deployment_status(where: str, reports: list[Any], unreadable: list[int]) -> DeploymentStatus:
    """Fold rank reports into the deployment's status, with the host disk budget its
    workers recorded (``spoolctl_host_max_size``) or why that record is unreadable;
    ``unreadable``: ranks whose store could not be opened (they make the ranks disagree)."""
    from spoolctl.connector.deployment import host_budget
    from spoolctl.connector.deployment.topology import deployment_status

    budget, error = None, None
    try:
        budget = host_budget.read(Path(where))
    except host_budget.HostBudgetError as exc:
        error = str(exc)
    return deployment_status(where, reports, host_max_bytes=budget, host_budget_error=error,
                             unreadable=unreadable)


def _deployment_view(doc: dict[str, Any]) -> list[Any]:
    from rich.text import Text
    if not doc["stores"]:
        return [Text(f"nothing to show: no spoolctl store under {plain(doc['root'])} yet "
                     "(no vLLM deployment has started)")]
    out: list[Any] = []
    errors = {(s.get("deployment") or "", s["rank"]): s["error"] for s in doc["stores"]
              if "error" in s}
    outs = {(s.get("deployment") or "", s["rank"]): s["result"]["status"]["out_of_service"]
            for s in doc["stores"] if "out_of_service" in s.get("result", {}).get("status", {})}
    for name, dep in sorted(doc["deployments"].items()):
        out.extend(_one_deployment_view(name, dep, errors, outs))
    for (name, rank), error in sorted(errors.items()):
        if name not in doc["deployments"]:
            out.append(Text.assemble((f"{plain(name)}/rank-{rank:04d}: ", "bold"),
                                     ("error: ", "red"), plain(error)))
    return out


def _one_deployment_view(name: str, dep: dict[str, Any], errors: dict,
                         outs: dict[tuple[str, int], dict[str, Any]]) -> list[Any]:
    from rich.table import Table
    from rich.text import Text

    from spoolctl.connector.deployment.description import summary

    title = f"spoolctl status (deployment {esc(name)}, {len(dep['ranks'])} ranks)"
    t = Table(title=title, title_justify="left")
    budgets = any(row.get("write_budget") is not None for row in dep["ranks"])
    for col in ("rank", "chunks", "size", "max size", "usage", "quarantined", "missing chunks",
                *(("written today (UTC)",) if budgets else ()), "root"):
        t.add_column(col)
    for row in dep["ranks"]:
        miss = row["missing_chunks"]
        cap = row.get("max_bytes")
        t.add_row(f"{row['rank']:04d}", str(row["chunks"]), render.size(row["bytes"]),
                  render.size(cap) if cap else "none",
                  f"{100 * row['bytes'] / cap:.1f}%" if cap else "-",
                  str(row["quarantined"]), f"[red]{miss}[/red]" if miss else "0",
                  *((_budget_cell(row.get("write_budget")),) if budgets else ()),
                  text(row["root"]))
    for (dep_name, rank), error in sorted(errors.items()):
        if dep_name == name:
            t.add_row(f"{rank:04d}", "-", "-", "-", "-", "-", "-", *(("-",) if budgets else ()),
                      Text(f"error: {plain(error)}", style="red"))
    desc = dep.get("description")
    what = Text(summary(desc) if desc else dep.get("description_error") or
                "no deployment.json yet (written when its workers start)",
                style=None if desc else "yellow")
    hits = _hit_rate_line(dep)
    if dep["agree"]:
        verdict = f"ranks agree: {dep['complete_chunks']} chunks on every rank"
    else:
        gaps = ", ".join(f"{r:04d}" for r in dep["missing_ranks"])
        unread = ", ".join(f"{r:04d}" for r in dep.get("unreadable_ranks", []))
        verdict = ("[red]ranks disagree[/red]: "
                   + (f"no store for rank {gaps}; " if gaps else "")
                   + (f"rank {unread} could not be read; " if unread else "")
                   + f"{dep['complete_chunks']} chunks on every rank; a chunk missing "
                   "on any rank is a miss everywhere until re-stored")
    offs = [out_of_service_line(f"rank {rank:04d}", off)
            for (dep_name, rank), off in sorted(outs.items()) if dep_name == name]
    return [what, t, *offs, verdict, _host_line(dep["host"]),
            _lifecycle_line(dep.get("lifecycle")), hits]


def _lifecycle_line(life: dict[str, Any] | None) -> Text:
    """What the deployment is for (model, weights), when it was last used, and whether a
    newer one replaced it (``clean --superseded`` reclaims it)."""
    from rich.text import Text
    if not life:
        return Text("")
    weights = str(life.get("weights") or "not bound (stored before weights were)")[:24]
    used = render.past_time(life["last_used"]) if life.get("last_used") else "never"
    model = plain(str(life["model"])) if life.get("model") else "unknown (not recorded)"
    line = Text(f"model {model}, weights {plain(weights)}; "
                f"last used {used}; {render.size(life['bytes'])} in {life['entries']} chunks")
    if life["state"] == "superseded":
        line.append(f"\nsuperseded ({life['reason']}) by {str(life['successor'])[:24]}: "
                    "nothing will read it again; `spoolctl clean --superseded --yes` "
                    "reclaims it", style="yellow")
    return line


def _host_line(host: dict[str, Any]) -> Text:
    """The deployment's host total against its host disk budget (``spoolctl_host_max_size``)."""
    from rich.text import Text
    total = render.size(host["bytes"])
    if host.get("error"):
        return Text(f"host total {total}; host budget record unreadable: {plain(host['error'])}")
    if not host["max_bytes"]:
        return Text(f"host total {total} (no host budget)")
    return Text(f"host total {total} of {render.size(host['max_bytes'])} host budget "
                f"({host['usage_pct']:.1f}%)")
