"""Setting up and looking at stores: ``init`` and ``status`` (its documents and views:
``store_status``, ``deployment_status``).

Each command parses its options, resolves ``--root`` into stores (``targets``: one store,
a vLLM deployment directory or a base root), asks each store for one document and
``emit``s it: a rich view for people, JSON for scripts (``--json``). Exit codes: 0 ok,
1 findings, 2 usage/configuration error (raised as ConfigError and turned into one line
by ``app.main``); on several stores, the worst of them (``fanout``).
"""

from __future__ import annotations

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
    first_root,
    open_store,
    plain,
)
from .deployment_status import deployment_status_doc, deployment_view
from .disk_deadline import within_disk_timeout
from .fanout import StoreJob, finish, run_on_targets, run_per_drive, worst
from .store_status import models_doc, status_doc, status_view
from .targets import StoreTarget, Targets, resolve_targets, targets_from_json, targets_json

# This module's commands: cli/commands.py adds them to the spoolctl app (the one place
# that lists every command).
commands = typer.Typer()

if TYPE_CHECKING:
    from spoolctl.store import Store


# -- init -----------------------------------------------------------------------------


def _init_job(max_bytes: int | None) -> StoreJob:
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
        from spoolctl.controllers.local.store_open import default_max_bytes

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
    if drives is not None:  # several drives: a row each, and totals
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
        return doc, EXIT_FINDINGS if check and attention else EXIT_OK, status_view
    doc, findings = deployment_status_doc(targets)
    errors = worst([s["exit"] for s in doc["stores"] if "error" in s])
    return doc, errors or (EXIT_FINDINGS if check and findings else EXIT_OK), deployment_view


def _status_totals(doc: dict[str, Any]) -> dict[str, int]:
    """One store's entries and bytes (a rank store's are under ``status``)."""
    facts = doc.get("status", doc)
    return {"stores": 1, "entries": int(facts.get("entries") or 0),
            "bytes": int(facts.get("bytes") or 0)}


