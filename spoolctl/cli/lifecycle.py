"""Stale vLLM deployments and controller models for ``status``, ``doctor`` and ``clean``.

Reads what each rank store says about its deployment (entries, bytes, first stored, last
used, the identity facts of one manifest) and asks ``connector.staleness`` for a verdict;
``reclaim`` releases a stale rank store's chunks so that the clean's ``released`` step
deletes them. Works on stores opened read-only (status, doctor).
"""

from __future__ import annotations

import time
from typing import Any

from spoolctl.store import DeploymentUse, SpoolError, Store, Verdict, judge

from .fanout import run_each
from .targets import StoreTarget, Targets

KIND = "vllm"


def rank_use(store: Store, name: str, rows: list[Any] | None = None) -> DeploymentUse:
    """One rank store's use of its deployment; ``rows``: its vllm catalog rows if already
    listed. The identity comes from its newest retained entry's manifest (None if that
    cannot be read)."""
    rows = store.entries(kind=KIND) if rows is None else rows
    live = [r for r in rows if r.state == "committed" and r.hint == "retain"]
    identity = None
    if live:
        newest = max(live, key=lambda r: r.created)
        try:
            doc = store.manifest(newest.entry_id).meta.get("deployment")
            identity = doc if isinstance(doc, dict) else None
        except (SpoolError, OSError, ValueError, AttributeError):
            identity = None
    return DeploymentUse(name, len(live), sum(r.size for r in live),
                         min((r.created for r in live), default=None),
                         max((r.last_access for r in live), default=None), identity)


def siblings(targets: Targets) -> Targets:
    """What a verdict must compare: every deployment of the base root, also when ``targets``
    is narrowed (``--deployment``, ``--rank``) or is one deployment directory under a base
    root (a successor is a sibling)."""
    from .targets import resolve_targets

    base = targets.given if targets.kind == "base" else targets.given.parent \
        if targets.kind == "deployment" else None
    if base is None:
        return targets
    try:
        found = resolve_targets(base)
    except SpoolError:  # the parent is not a base root: judge what was given
        return targets
    return found if found.kind == "base" else targets


def deployment_uses(targets: Targets) -> dict[str, DeploymentUse]:
    """Every deployment's use, its ranks merged (ranks that cannot be opened are left out)."""
    def job(store: Store, target: StoreTarget) -> tuple[dict[str, Any], int]:
        return {"use": rank_use(store, target.deployment or "")}, 0

    per: dict[str, list[DeploymentUse]] = {}
    for result in run_each(targets, job, read_only_ok=True):
        if result.doc is not None:
            per.setdefault(result.target.deployment or "", []).append(result.doc["use"])
    return {name: DeploymentUse.merge(name, parts) for name, parts in per.items()}


def verdicts(uses: dict[str, DeploymentUse], *, unused_for: float | None = None,
             now: float | None = None) -> dict[str, Verdict]:
    return judge(uses.values(), now=time.time() if now is None else now,
                 unused_for=unused_for)


def lifecycle_json(use: DeploymentUse, verdict: Verdict) -> dict[str, Any]:
    """The ``lifecycle`` of one deployment in ``status --json``."""
    ident = use.identity or {}
    return {**verdict.to_json(), "entries": use.entries, "bytes": use.bytes,
            "first_stored": use.first_stored, "last_used": use.last_used,
            "model": ident.get("model"), "weights": ident.get("weights"),
            "engine": ident.get("engine")}


def reclaim(store: Store, *, dry_run: bool) -> tuple[list[str], int]:
    """Release every retained chunk of a stale deployment's rank store (the ``released``
    clean step then deletes them); returns (entry ids, bytes) released or, dry, to
    release."""
    rows = [r for r in store.entries(kind=KIND)
            if r.state == "committed" and r.hint == "retain"]
    if not dry_run:
        for row in rows:
            store.release(row.entry_id)
    return [r.entry_id for r in rows], sum(r.size for r in rows)


# -- controller models -------------------------------------------------------------------


def model_uses(store: Store) -> dict[str, DeploymentUse]:
    """Each controller namespace of one store (``model_lifecycle.KINDS``), by namespace:
    its retained entries, bytes, first stored, last used, and the identity of its newest
    entry's manifest (with the kind added; None if that cannot be read)."""
    from spoolctl.controllers.local.model_lifecycle import KINDS as MODEL_KINDS

    groups: dict[str, list[Any]] = {}
    for kind in MODEL_KINDS:
        for row in store.entries(kind=kind):
            if row.state == "committed" and row.hint == "retain":
                groups.setdefault(row.namespace, []).append(row)
    out: dict[str, DeploymentUse] = {}
    for namespace, rows in groups.items():
        newest = max(rows, key=lambda r: r.created)
        try:
            doc = store.manifest(newest.entry_id).meta.get("identity")
            identity = {**doc, "kind": newest.kind} if isinstance(doc, dict) else None
        except (SpoolError, OSError, ValueError, AttributeError):
            identity = None
        out[namespace] = DeploymentUse(namespace, len(rows), sum(r.size for r in rows),
                                       min(r.created for r in rows),
                                       max(r.last_access for r in rows), identity)
    return out


def model_verdicts(uses: dict[str, DeploymentUse], *, unused_for: float | None = None,
                   now: float | None = None) -> dict[str, Verdict]:
    from spoolctl.controllers.local.model_lifecycle import judge_models

    return judge_models(uses.values(), now=time.time() if now is None else now,
                        unused_for=unused_for)


def model_json(use: DeploymentUse, verdict: Verdict) -> dict[str, Any]:
    """One controller model in ``status --json`` (``models.<namespace>``)."""
    from spoolctl.controllers.local.model_lifecycle import weights

    ident = use.identity or {}
    return {**verdict.to_json(), "kind": ident.get("kind"), "entries": use.entries,
            "bytes": use.bytes, "first_stored": use.first_stored, "last_used": use.last_used,
            "model": ident.get("model"), "framework": ident.get("framework"),
            "weights": weights(ident)}


def stale_models(store: Store, *, superseded: bool, unused_for: float | None,
                 now: float | None = None) -> dict[str, Verdict]:
    """The controller namespaces of ``store`` the chosen rules reclaim."""
    judged = model_verdicts(model_uses(store), unused_for=unused_for, now=now)
    return {name: v for name, v in judged.items()
            if (superseded and v.state == "superseded") or v.state == "unused"}


def reclaim_models(store: Store, namespaces: set[str], *,
                   dry_run: bool) -> tuple[list[str], int]:
    """Release every retained entry of ``namespaces`` (the ``released`` clean step then
    deletes them); returns (entry ids, bytes) released or, dry, to release."""
    from spoolctl.controllers.local.model_lifecycle import KINDS as MODEL_KINDS

    rows = [r for kind in MODEL_KINDS for r in store.entries(kind=kind)
            if r.namespace in namespaces and r.state == "committed" and r.hint == "retain"]
    if not dry_run:
        for row in rows:
            store.release(row.entry_id)
    return [r.entry_id for r in rows], sum(r.size for r in rows)
