"""Verification commands: ``scrub`` (deep, resumable) and ``request-auth`` (one entry now),
on one store or on every rank store of a vLLM deployment directory or base root.

A scrub never stops at the same object run after run: an object it cannot read is an
``unreadable`` finding (exit 1) and the cycle moves on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from spoolctl.store import BusyError, CorruptionError, parse_rate, validate_entry_prefix

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
    text,
)
from .entry_cmds import found_in
from .fanout import (
    finish,
    multi_doc,
    multi_view,
    on_drive,
    run_each,
    run_on_targets,
    run_per_drive,
)
from .targets import StoreTarget, resolve_entry, resolve_targets

if TYPE_CHECKING:
    from rich.table import Table

    from spoolctl.store import Store

# This module's commands: cli/commands.py adds them to the spoolctl app (the one place
# that lists every command).
commands = typer.Typer()

DEFAULT_STEP_ITEMS = 10_000


def parse_rate_option(text: str) -> int | None:
    """``64MiB/s`` -> bytes per second; ``0`` or ``unlimited`` -> None (no pacing)."""
    if text.strip().lower() in ("0", "unlimited", "none"):
        return None
    return parse_rate(text)


@commands.command("scrub")
def scrub_cmd(
    root: RootsOption = None,
    rate: Annotated[str, typer.Option(
        "--rate", help="Byte rate limit, e.g. 64MiB/s (0 = unlimited).")] = "64MiB/s",
    max_items: Annotated[int, typer.Option(
        "--max-items", min=1, help="Verify at most N entries this run (resumes next run).")] =
        DEFAULT_STEP_ITEMS,
    until_complete: Annotated[bool, typer.Option(
        "--until-complete", help="Keep going until the current cycle completes.")] = False,
    rank: RankOption = None,
    deployment: DeploymentOption = None,
    json_output: JsonOption = False,
) -> None:
    """Deep scrub: re-read and verify every manifest and object at a bounded rate.

    Resumes where the last scrub stopped. Quarantines what fails and records what it
    cannot read (exit 1), and at the end of a cycle reclaims proven orphans and abandoned
    temp files. On a vLLM base root or deployment directory: one step on every rank
    store (`--max-items` per rank).

    Example (cron): [bold]spoolctl scrub --rate 64MiB/s --until-complete[/bold]
    """
    from spoolctl.store import Scrubber
    rate_bytes = parse_rate_option(rate)

    def job(store: Store, target: StoreTarget) -> tuple[dict[str, Any], int]:
        total = store.totals().entries
        scrubber = Scrubber(store, rate_bytes=rate_bytes)
        label = "scrub" if target.rank is None else f"scrub rank {target.rank:04d}"
        with render.progress_bar(label, total, enabled=not json_output) as bar:
            report = scrubber.run(
                max_items=max_items, until_complete=until_complete, wait=True,
                progress=lambda cycle, n: bar.update(
                    completed=cycle.done, total=max(n, cycle.total_at_start, 1)))
        assert report is not None  # wait=True: BusyError instead of None
        findings = report.quarantined or report.unreadable
        # what a clean pass proves: digests only, or with a tag key also the writer
        doc = {**report.to_json(), "proves": "integrity" if store.tag_key is None else "origin"}
        return doc, EXIT_FINDINGS if findings else EXIT_OK

    drives = drive_roots(root)
    if drives is not None:  # several drives: a row each, and totals
        finish(run_per_drive(drives, lambda one: on_drive(
            resolve_targets(one, rank=rank, deployment=deployment), job, view=_scrub_view),
            json_output=json_output, totals=_scrub_totals))
        return
    targets = resolve_targets(first_root(root), rank=rank, deployment=deployment)
    finish(run_on_targets(targets, job, json_output=json_output, view=_scrub_view))


def _scrub_totals(doc: dict[str, Any]) -> dict[str, int]:
    """What one store's scrub step counted (summed over the drives)."""
    return {"stores": 1, **{k: int(doc.get(k) or 0) for k in
                            ("checked", "bytes", "quarantined", "unreadable")}}


def _scrub_view(doc: dict[str, Any]) -> Table:
    from rich.table import Table
    t = Table(title=f"scrub cycle {doc['cycle_id']}{' (resumed)' if doc['resumed'] else ''}",
              show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    # The JSON's word (`checked`) with what the check proved: one name per concept.
    how = "authenticated (tags)" if doc.get("proves") == "origin" else "verified (digests)"
    t.add_row("checked", f"{doc['checked']} entries, {render.size(doc['bytes'])}: {how}")
    found = doc["quarantined"]
    t.add_row("quarantined", f"[red]{len(found)}[/red]" if found else "0")
    for q in found[:20]:
        t.add_row("", text(f"{q['entry_id'][:16]}  {q['reason']}"))
    unreadable = doc.get("unreadable", [])
    if unreadable:
        t.add_row("unreadable", f"[red]{len(unreadable)}[/red] (moved on; `spoolctl doctor`)")
        for u in unreadable[:20]:
            t.add_row("", text(f"{u['entry_id'][:16]}  {u['detail']}"))
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


@commands.command("request-auth")
def request_auth_cmd(
    entry: Annotated[str, typer.Argument(help="Entry id (64 hex) or unique prefix.")],
    root: RootOption = None,
    wait: Annotated[bool, typer.Option(
        "--wait", help="When a worker owns the store, wait for its receipt.")] = False,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=0.0, help="Seconds to wait for the receipt.")] = 60.0,
    rank: RankOption = None,
    deployment: DeploymentOption = None,
    json_output: JsonOption = False,
) -> None:
    """Check one entry now: authenticated or verified (0), absent or quarantined (1).

    authenticated: a tag key is configured (SPOOLCTL_TAG_KEY_FILE) and the entry's tag
    and every digest are valid, so a holder of the key wrote it. verified: no key, so
    only the digests were checked: integrity, not who wrote it. If a live worker owns
    the store the request is queued for it (and answered with its key). On a vLLM base root
    or deployment directory, the entry is looked for in every rank store.

    Example: [bold]spoolctl request-auth 3fa9c2d1 --wait --timeout 30[/bold]
    """
    validate_entry_prefix(entry)
    targets = resolve_targets(root, rank=rank, deployment=deployment)

    def job(store: Store, _target: StoreTarget) -> tuple[dict[str, Any], int]:
        return _request_auth(store, entry, wait, timeout)

    if targets.single:
        finish(run_on_targets(targets, job, json_output=json_output, view=_result_view))
        return
    results = run_each(targets, job)
    if len(entry) == 64:  # a full id: absent where it is not; keep the ranks that know it
        known = [r for r in results if not (r.doc and r.doc.get("result") == "absent")]
        results = known or results
    else:
        results = found_in(results, f"no entry {entry[:64]} under {targets.given}")
    doc = multi_doc(targets, results)
    emit(doc, json_output=json_output, view=multi_view(_result_view))
    finish(doc["exit"])


def _result_view(doc: dict[str, Any]) -> Any:
    return _queued_view(doc) if doc.get("result") == "queued" else _auth_view(doc)


def _request_auth(store: Store, entry: str, wait: bool, timeout: float
                  ) -> tuple[dict[str, Any], int]:
    """One store's answer for ``entry`` (see ``request_auth_cmd``)."""
    from spoolctl.store import AuthQueue, authenticate
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
                return {"entry_id": entry_id, "result": "queued", "request_id": request_id,
                        "owner": owner.to_json()}, EXIT_OK
            receipt = queue.wait(request_id, timeout)
        if receipt is None:
            raise BusyError(
                f"no receipt from the owner ({owner.role} pid {owner.pid}) within "
                f"{timeout:g}s; request {request_id} stays queued",
                path=store.root, fix="retry with a longer --timeout, or check the worker")
        result = receipt
    return result.to_json(), EXIT_OK if result.healthy else EXIT_FINDINGS


def _queued_view(doc: dict[str, Any]) -> str:
    owner = doc["owner"]
    return (f"queued request {doc['request_id']} for {esc(owner['role'])} pid "
            f"{owner['pid']}; rerun with --wait to wait for the receipt")


_RESULT_COLORS = {"authenticated": "green", "verified": "green", "absent": "yellow",
                  "quarantined": "red"}


def _auth_view(doc: dict[str, Any]) -> str:
    color = _RESULT_COLORS[doc["result"]]
    extra = f" ({esc(doc['reason'])})" if doc.get("reason") else ""
    return (f"[{color}]{doc['result']}[/{color}]{extra}  {esc(doc['entry_id'])}  "
            f"{esc(doc['detail'])}{'  via owner' if doc.get('via') == 'owner' else ''}")
