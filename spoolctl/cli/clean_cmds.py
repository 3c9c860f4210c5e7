"""``spoolctl clean``: the cron job. The store plans and runs the deletions as data
(``Store.clean``); this command parses, asks (interactive, without ``--yes``) and renders,
on one store or on every rank store of a vLLM deployment directory or base root.

One bad part never stops it: a malformed catalog row is skipped and reported, a file
that cannot be deleted is counted, a step that fails is recorded while the others run,
and a rank that fails does not stop the other ranks. Exit 0: done; 1: findings
(something quarantined, files that could not be deleted, malformed rows, a failed remote
delete, a genai record whose endpoint was refused); 2: a step or a store failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from spoolctl.store import ConfigError, SpoolError, parse_duration

from . import render
from .common import (
    EXIT_FINDINGS,
    EXIT_OK,
    EXIT_USAGE,
    DeploymentOption,
    JsonOption,
    RankOption,
    RootsOption,
    console,
    drive_roots,
    err_console,
    first_root,
    open_store,
    text,
)
from .fanout import StoreJob, finish, on_drive, run_on_targets, run_per_drive
from .targets import StoreTarget, Targets, resolve_targets

# This module's commands: cli/commands.py adds them to the spoolctl app (the one place
# that lists every command).
commands = typer.Typer()

if TYPE_CHECKING:
    from rich.table import Table

    from spoolctl.store import Store, Verdict


@commands.command("clean")
def clean_cmd(
    root: RootsOption = None,
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
    genai_endpoint: Annotated[list[str] | None, typer.Option(
        "--genai-endpoint", help="Also send credentials to this origin (scheme://host:port) "
        "when a record names it; besides Google's https endpoints only these and "
        "SPOOLCTL_GENAI_ENDPOINTS are used. Repeatable.")] = None,
    superseded: Annotated[bool, typer.Option(
        "--superseded", help="Reclaim vLLM deployments and controller models a newer one of "
        "the same model replaced (new weights, a framework upgrade) that nothing used since "
        "(see `status`).")] = False,
    unused_for: Annotated[str | None, typer.Option(
        "--unused-for", help="Reclaim vLLM deployments and controller models not used for "
        "this long (e.g. 30d).")] = None,
    min_age: Annotated[str, typer.Option(
        "--min-age", help="Orphans and temp files must be this old (e.g. 1h).")] = "1h",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report; change nothing.")] =
        False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask (needed under cron).")] =
        False,
    rank: RankOption = None,
    deployment: DeploymentOption = None,
    json_output: JsonOption = False,
) -> None:
    """Delete what is safe to delete (the cron job).

    Released entries, capacity overflow, abandoned temp files and orphan objects: all
    four when no selector is given. Works on a full disk. Given a vLLM base root (the
    root of `spoolctl config vllm`) or a deployment directory, cleans every rank store
    under it and reports per rank. `--superseded` and `--unused-for` reclaim whole vLLM
    deployments, or on a controller's store whole models (PyTorch, MLX), by rule (alone,
    only those and the released step run).

    Example (cron): [bold]spoolctl clean --yes --json[/bold]
    """
    from spoolctl.store import CLEAN_STEPS
    age = parse_duration(min_age)
    endpoints = _endpoint_policy(genai, genai_endpoint or [])
    unused = parse_duration(unused_for) if unused_for is not None else None
    chosen = {"released": released, "capacity": capacity, "tmp": tmp, "orphans": orphans}
    by_rule = superseded or unused is not None
    steps = [step for step in CLEAN_STEPS if chosen[step]] or \
        (["released"] if by_rule else list(CLEAN_STEPS))
    if by_rule and "released" not in steps:
        steps = ["released", *steps]  # what reclaiming a deployment releases is deleted

    def prepare(drive: Path | None) -> tuple[Targets, StoreJob]:
        """The stores under ``drive`` (a --root) and the job to run on each (after the plan is shown
        and confirmed)."""
        targets = resolve_targets(drive, rank=rank, deployment=deployment)
        stale = _stale_deployments(targets, superseded, unused) if by_rule else {}

        def make_job(dry: bool, remote: bool) -> StoreJob:
            def job(store: Store, _target: StoreTarget) -> tuple[dict[str, Any], int]:
                # before local cleanup: settles holds
                remote_doc = _clean_genai(store, remote, dry, endpoints)
                lifecycle = _reclaim(store, stale.get(_target.deployment or ""), dry) \
                    if by_rule and not targets.single else None
                models = _reclaim_models(store, superseded, unused, dry) \
                    if by_rule and targets.single else None
                # A dry run counts what the rules would release in its released step,
                # so its totals are what the real run deletes.
                rule_ids = [*(lifecycle or {}).pop("_ids", []),
                            *(e for m in (models or {}).values() for e in m.pop("_ids", []))]
                report = store.clean(steps, min_age=age, dry_run=dry, also_released=rule_ids)
                doc = {**report.to_json(), "genai": remote_doc}
                if lifecycle is not None:
                    doc["deployment_lifecycle"] = lifecycle
                if models is not None:
                    doc["model_lifecycle"] = models
                where = "" if _target.rank is None else f"{_target.label}: "
                for step, error in report.errors.items():  # on stderr too: cron mails it
                    err_console.print(text(f"error: {where}clean {step}: {error}"),
                                      soft_wrap=True)
                if report.errors or remote_doc.get("error"):
                    return doc, EXIT_USAGE
                findings = report.quarantined or report.failed or report.malformed_count or \
                    remote_doc.get("failed") or remote_doc.get("malformed") or \
                    remote_doc.get("refused")
                return doc, EXIT_FINDINGS if findings else EXIT_OK
            return job

        if render.require_yes(yes, dry_run, "clean") and targets.stores:
            # The plan shown is the dry run of this very command (server calls aside), and
            # nothing is asked when it deletes nothing.
            plan_job = make_job(True, False)
            plans = []
            for target in targets.stores:
                with open_store(target.root) as store:
                    plans.append((target, plan_job(store, target)[0]))
            if any(any(plan["total"].values()) for _, plan in plans) or genai:
                for target, plan in plans:
                    console.print(text(target.label, "bold"))
                    why = stale.get(target.deployment or "")
                    if why is not None:
                        console.print(text(f"whole deployment: {why.state} ({why.reason})",
                                           "yellow"))
                    for line in _clean_view(plan):
                        console.print(line)
                if not typer.confirm("Delete these?", default=False):
                    raise typer.Exit(EXIT_OK)

        # A dry run only reads: on a store this user cannot write it plans from a read-only
        # view, like ls and status.
        job = make_job(dry_run, genai)
        return targets, job

    drives = drive_roots(root)
    if drives is not None:  # several drives: a row each, and totals
        render.require_yes(yes, dry_run, "clean")  # no --yes under cron: one line, not one a drive
        finish(run_per_drive(drives, lambda one: on_drive(
            *prepare(one), view=_clean_view, read_only_ok=dry_run),
            json_output=json_output, totals=_clean_totals))
        return
    targets, job = prepare(first_root(root))
    finish(run_on_targets(targets, job, json_output=json_output, view=_clean_view,
                          read_only_ok=dry_run))


def _clean_totals(doc: dict[str, Any]) -> dict[str, int]:
    """What one store's clean deleted (or would), summed over the drives."""
    return {"stores": 1, **{k: int(v) for k, v in (doc.get("total") or {}).items()
                            if isinstance(v, int) and not isinstance(v, bool)}}


def _endpoint_policy(enabled: bool, extra: list[str]) -> Any:
    """Where ``--genai`` may send credentials besides Google (operator configuration only:
    ``--genai-endpoint`` and ``SPOOLCTL_GENAI_ENDPOINTS``); checked before any store opens."""
    if not enabled:
        if extra:
            raise ConfigError("--genai-endpoint without --genai", fix="add --genai")
        return None
    from spoolctl.controllers.genai.endpoints import EndpointPolicy

    return EndpointPolicy.from_operator(extra)


def _stale_deployments(targets: Targets, superseded: bool,
                       unused: float | None) -> dict[str, Verdict]:
    """The deployments the chosen rules reclaim, by directory name. On one store the rules
    judge its controller models instead (``_reclaim_models``); a vLLM rank store given alone
    is a usage error (its deployment's siblings are what the rules compare)."""
    from .lifecycle import deployment_uses, siblings, verdicts

    if targets.single:
        with open_store(targets.given, read_only_ok=True) as store:
            chunks = bool(store.entries(kind="vllm", limit=1))
        if chunks:
            raise ConfigError("--superseded and --unused-for judge vLLM deployments on a "
                              "base root or deployment directory, not on one rank store",
                              path=targets.given,
                              fix="point --root at the root given to `spoolctl config vllm`")
        return {}
    judged = verdicts(deployment_uses(siblings(targets)), unused_for=unused)
    return {name: v for name, v in judged.items()
            if (superseded and v.state == "superseded") or v.state == "unused"}


def _reclaim(store: Store, verdict: Verdict | None, dry_run: bool) -> dict[str, Any]:
    """Release a stale deployment's chunks on this rank (the released step deletes them)."""
    from .lifecycle import reclaim

    if verdict is None:
        return {"reclaimed": False, "state": "current"}
    ids, size = reclaim(store, dry_run=dry_run)
    return {"reclaimed": True, **verdict.to_json(), "entries": len(ids), "bytes": size,
            "_ids": ids}


def _reclaim_models(store: Store, superseded: bool, unused: float | None,
                    dry_run: bool) -> dict[str, Any]:
    """Release the entries of this store's stale controller models: per
    namespace its verdict and what is (or, dry, would be) released."""
    from .lifecycle import reclaim_models, stale_models

    stale = stale_models(store, superseded=superseded, unused_for=unused)
    out: dict[str, Any] = {}
    for namespace, verdict in sorted(stale.items()):
        ids, size = reclaim_models(store, {namespace}, dry_run=dry_run)
        out[namespace] = {**verdict.to_json(), "entries": len(ids), "bytes": size,
                          "_ids": ids}
    return out


def _clean_genai(store: Store, enabled: bool, dry_run: bool,
                 endpoints: Any = None) -> dict[str, Any]:
    """Server-side deletes owed by released/expired genai caches (``--genai``); without the
    flag, only say what was skipped. A record that cannot be read is counted, never fatal."""
    if not enabled:
        pending, malformed = _pending_remote(store)
        lines = [f"skipped {pending} genai cache(s) still to delete on the server: "
                 "rerun with --genai and credentials"] if pending else []
        if malformed:
            lines.append(f"{malformed} genai record(s) could not be read and were skipped "
                         "(`spoolctl clean --genai` re-indexes them; `spoolctl doctor`)")
        return {"skipped_pending": pending, "malformed": malformed, "lines": lines}
    from spoolctl.controllers.genai.clean import clean_remote

    try:
        report = clean_remote(store, dry_run=dry_run, endpoints=endpoints)
    except (SpoolError, ValueError, TypeError, KeyError) as exc:  # one bad record
        return {"error": str(exc)[:300], "lines": [f"genai step failed: {str(exc)[:300]}; the "
                                                    "local steps still ran"]}
    return {**report.to_json(), "lines": report.lines()}


def _pending_remote(store: Store) -> tuple[int, int]:
    """(released genai caches still owed a server delete, records that could not be read):
    row by row, so one bad record is counted and skipped."""
    import time

    from spoolctl.controllers.genai.records import status_of_row

    now, pending, malformed = time.time(), 0, 0
    for row in store.entries(kind="genai"):
        try:
            pending += status_of_row(row, now).state == "delete-pending"
        except (ValueError, TypeError, KeyError, AttributeError):
            malformed += 1
    return pending, malformed


def _steps_table(steps: dict[str, dict[str, Any]], dry_run: bool) -> Table:
    from rich.table import Table
    t = Table(title="would delete (dry run)" if dry_run else "deleted", title_justify="left")
    for col in ("step", "entries", "objects", "files", "bytes"):
        t.add_column(col, justify="left" if col == "step" else "right")
    for step, r in steps.items():
        t.add_row(step, str(r.get("entries", 0)), str(r.get("objects", 0)),
                  str(r.get("files", 0)), render.size(r.get("bytes", 0)))
    return t


def _clean_view(doc: dict[str, Any]) -> list[Any]:
    # Lines about remote caches carry server text, rows and paths carry store text:
    # printed as plain text, never markup.
    out: list[Any] = [_steps_table(doc["steps"], doc["dry_run"])]  # step errors: stderr
    malformed = doc.get("malformed_rows") or {}
    if malformed.get("count"):
        out.append(text(f"skipped {malformed['count']} malformed catalog row(s), e.g. "
                        + "; ".join(f"{r['entry_id'][:16]}: {r['reason']}"
                                    for r in malformed["rows"][:3])
                        + " (`spoolctl clean --orphans` re-indexes them)", "yellow"))
    if doc.get("failed"):
        out.append(text(f"{doc['failed']} file(s) or directories could not be deleted or "
                        "read (`spoolctl doctor` says why)", "yellow"))
    out.extend(text(line) for line in doc["genai"].get("lines", []))
    for namespace, model in (doc.get("model_lifecycle") or {}).items():
        out.append(text(f"model {namespace} {model['state']} ({model['reason']}): "
                        f"{model['entries']} entries, {render.size(model['bytes'])} "
                        + ("to release" if doc["dry_run"] else "released"), "yellow"))
    life = doc.get("deployment_lifecycle")
    if life and life.get("reclaimed"):
        out.append(text(f"deployment {life['state']} ({life['reason']}): "
                        f"{life['entries']} chunk(s), {render.size(life['bytes'])} "
                        + ("to release" if doc["dry_run"] else "released"), "yellow"))
    return out
