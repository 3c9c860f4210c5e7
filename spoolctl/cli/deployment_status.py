"""``status`` of a vLLM deployment directory or base root: its rank stores, per deployment.

Per deployment: whether the ranks agree, the host total against its budget, the engine's
hit rate and the lifecycle verdict."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import render
from .common import EXIT_OK, esc, plain, text
from .fanout import multi_doc, run_each
from .store_status import out_of_service_line, status_doc
from .targets import StoreTarget, Targets

if TYPE_CHECKING:
    from rich.text import Text

    from spoolctl.connector.deployment.topology import DeploymentStatus
    from spoolctl.store import Store


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
    # Which deployments no longer match anything current.
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
    """The rank store's write budget today (its ledger beside it), None
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


def _dep_dir(targets: Targets, name: str) -> Path:
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


def deployment_view(doc: dict[str, Any]) -> list[Any]:
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


def _one_deployment_view(name: str, dep: dict[str, Any], errors: dict[tuple[str, int], str],
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
                style="" if desc else "yellow")
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
