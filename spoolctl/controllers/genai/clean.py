"""``clean_remote``: finish what ``release`` could not -- delete owed genai caches on the server.

Called by ``spoolctl clean --genai`` *before* ``Store.clean_released``:

* a record still owing a server delete (``remote_pending``) is deleted on its
  server (Gemini API or the Vertex AI project/location recorded in its manifest);
  success or "already gone" (404) settles it, a failure keeps it pending with the
  error recorded, and a target without credentials is skipped and reported;
* a record whose target is not Google's endpoint over https (nor an origin the operator
  allowed, ``genai_endpoints``) is refused before any client is built: no credentials go
  there, the record stays pending and lands in ``refused`` (a finding);
* the cache deleted is the one the record's manifest names, in the record's own project and
  location (``endpoints.scoped_name``): a catalog row naming another cache, or a manifest
  naming one of another project, location or API, is refused like a foreign endpoint;
* a record whose cache has expired is settled without a request (the service
  drops expired caches itself) and released, so local cleanup removes it.

Settled records are released and no longer held, so ``clean_released`` deletes
them; pending ones are skipped by it. A record whose facts cannot be read (a value that
is not what spoolctl writes, ``records.index_problem``) is skipped and reported in
``malformed``; the others are still handled (one bad row never stops the job).
google-genai is imported only when a server delete is actually attempted with the
default client factory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spoolctl.store import ConfigError, MalformedRow, NotFoundError, SpoolError, Store

from .endpoints import EndpointPolicy, owned_name_refusal, scoped_name
from .records import (
    KIND,
    GenaiRecord,
    GenaiTarget,
    expire_of,
    index_problem,
    index_problems,
    remote_error,
)

ClientFactory = Callable[[GenaiTarget], Any]
"""Returns a ``google.genai.Client`` for a target, or None (or raises ConfigError with the
reason) when no credentials are available for it."""

API_KEY_VARS = ("GEMINI_API_KEY", "GOOGLE_API_KEY")


@dataclass
class GenaiCleanReport:
    """What ``clean_remote`` did (or would do under ``dry_run``)."""

    deleted: list[str] = field(default_factory=list)
    already_gone: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    malformed: list[tuple[str, str]] = field(default_factory=list)  # (entry id, reason)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (name, one line): endpoint
    repaired: list[str] = field(default_factory=list)  # entry ids re-indexed from manifests
    dry_run: bool = False

    @property
    def ok(self) -> bool:
        return not self.failed and not self.refused

    def to_json(self) -> dict[str, Any]:
        return {"deleted": self.deleted, "already_gone": self.already_gone,
                "expired": self.expired,
                "failed": [{"name": n, "error": e} for n, e in self.failed],
                "skipped": [{"name": n, "reason": r} for n, r in self.skipped],
                "refused": [{"name": n, "reason": r} for n, r in self.refused],
                "malformed": len(self.malformed),
                "malformed_records": [{"entry_id": e, "reason": r} for e, r in self.malformed],
                "repaired": self.repaired,
                "dry_run": self.dry_run}

    def lines(self) -> list[str]:
        """One line per fact, for people (the CLI prints these)."""
        verb = "would delete" if self.dry_run else "deleted"
        out = [f"genai: {verb} {len(self.deleted)} cache(s) on the server, "
               f"{len(self.already_gone)} already gone, {len(self.expired)} expired"]
        out += [f"genai: failed {n}: {e}" for n, e in self.failed]
        out += [f"genai: skipped {n}: {r}" for n, r in self.skipped]
        out += [f"genai: refused {n}: {r}" for n, r in self.refused]
        out += [f"genai: skipped malformed record {e[:16]}: {r} (`spoolctl doctor`)"
                for e, r in self.malformed]
        out += [f"genai: re-indexed record {e[:16]} from its manifest" for e in self.repaired]
        return out


def default_client_factory(target: GenaiTarget) -> Any:
    """A client for ``target`` from the usual environment, or ConfigError saying what is missing.

    Gemini API: ``GEMINI_API_KEY`` or ``GOOGLE_API_KEY``. Vertex AI: Application
    Default Credentials (``GOOGLE_APPLICATION_CREDENTIALS`` or gcloud's ADC file).
    The recorded base URL and API version are reused, so a cache is deleted on the
    server that made it -- which is why ``clean_remote`` checks the target against its
    ``EndpointPolicy`` before it calls any factory.
    """
    try:
        from google import genai
        from google.genai import types
    except ImportError:
        raise ConfigError("google-genai is not installed",
                          fix="pip install 'spoolctl[genai]'") from None
    options = None
    if target.base_url or target.api_version:
        options = types.HttpOptions(base_url=target.base_url, api_version=target.api_version)
    if target.api == "gemini":
        key = next((os.environ[v] for v in API_KEY_VARS if os.environ.get(v)), None)
        if key is None:
            raise ConfigError("no Gemini API key in the environment",
                              fix="set GOOGLE_API_KEY (or GEMINI_API_KEY)")
        return genai.Client(api_key=key, http_options=options)
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError

    try:
        creds, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
    except DefaultCredentialsError:
        raise ConfigError(f"no Google Cloud credentials for {target.describe()}",
                          fix="set GOOGLE_APPLICATION_CREDENTIALS or run "
                              "`gcloud auth application-default login`") from None
    return genai.Client(vertexai=True, project=target.project, location=target.location,
                        credentials=creds, http_options=options)


def clean_remote(
    store: Store,
    *,
    client_factory: ClientFactory | None = None,
    now: float | None = None,
    dry_run: bool = False,
    endpoints: EndpointPolicy | None = None,
) -> GenaiCleanReport:
    """Delete owed genai caches on their servers and settle expired records (see module doc).

    Never raises for a server or credential problem: each lands in ``failed`` or
    ``skipped`` with one line of explanation. Call ``store.clean_released()`` after
    it to drop the settled records. ``endpoints`` says where credentials may go
    (default: ``EndpointPolicy.from_operator()``, Google's endpoints plus
    ``SPOOLCTL_GENAI_ENDPOINTS``); it is checked whatever ``client_factory`` does.
    """
    factory = client_factory or default_client_factory
    policy = EndpointPolicy.from_operator() if endpoints is None else endpoints
    now = time.time() if now is None else now
    report = GenaiCleanReport(dry_run=dry_run)
    clients: dict[GenaiTarget, Any] = {}
    refusals: dict[GenaiTarget, str] = {}
    for row in store.entries(kind=KIND, sort="age"):
        if index_problems(row.index) and not dry_run and _repair(store, row.entry_id):
            report.repaired.append(row.entry_id)
            row = store.row(row.entry_id) or row
        index = row.index
        problem = index_problem(index)
        if problem is None and index.get("remote_pending") and not index.get("name"):
            problem = "a pending server delete without the cache's name"
        if problem is not None:
            report.malformed.append((row.entry_id, problem))
            continue
        name = str(index.get("name") or row.entry_id)
        pending = bool(index.get("remote_pending"))
        if expire_of(index) <= now:
            if row.hint == "retain" or pending:
                report.expired.append(name)
                if not dry_run:
                    _settle(store, row.entry_id)
            continue
        if not pending:
            continue  # live, or released and already deleted on the server
        try:
            record = GenaiRecord.from_manifest(store.manifest(row.entry_id), row)
        except MalformedRow as exc:
            report.malformed.append((row.entry_id, exc.reason))
            continue
        except SpoolError as exc:
            report.skipped.append((name, f"record unreadable: {exc}"))
            continue
        # The cache to delete is the one the manifest names (checked on load, tagged under a
        # tag key), never the catalog's copy: any writer of the store can edit that.
        target, name = record.target, record.name
        refused = policy.check(target, row.entry_id) or \
            owned_name_refusal(record, index.get("name"))
        if refused is not None:
            report.refused.append((name, refused))
            continue
        scoped = scoped_name(target, name)
        client = _client_for(target, factory, clients, refusals)
        if client is None:
            report.skipped.append((name, refusals[target]))
            continue
        if dry_run:
            report.deleted.append(name)
            continue
        try:
            client.caches.delete(name=scoped)
        except Exception as exc:
            err = remote_error(exc, "deleting a cached content", name)
            if isinstance(err, NotFoundError):
                report.already_gone.append(name)
                _settle(store, row.entry_id)
            else:
                report.failed.append((name, str(err)))
                store.update_index(row.entry_id, {"remote_error": str(err)[:300]})
            continue
        report.deleted.append(name)
        _settle(store, row.entry_id)
    return report


def _repair(store: Store, entry_id: str) -> bool:
    """Re-index the malformed fields of a genai record from its manifest (the values it was
    written with; ``remote_error``, which only the catalog holds, is cleared). True if the
    record is readable afterwards. A manifest that cannot be read repairs nothing."""
    row = store.row(entry_id)
    if row is None:
        return False
    bad = index_problems(row.index)
    if not bad or "*" in bad or {"expire_time", "remote_pending"} & set(bad):
        return False  # the store's own facts: `spoolctl clean --orphans` repairs those
    try:
        written = store.manifest(entry_id).index
    except SpoolError:
        return False
    fixes: dict[str, Any] = {}
    for f in bad:
        good = f in written and not index_problems({f: written[f]})
        if f != "remote_error" and not good:
            return False  # the manifest holds no good value either: nothing to repair from
        fixes[f] = written[f] if f != "remote_error" else None
    store.update_index(entry_id, fixes)
    fixed = store.row(entry_id)
    return fixed is not None and not index_problems(fixed.index)


def _client_for(target: GenaiTarget, factory: ClientFactory, clients: dict[GenaiTarget, Any],
                refusals: dict[GenaiTarget, str]) -> Any:
    if target in refusals:
        return None
    if target not in clients:
        try:
            client = factory(target)
        except ConfigError as exc:
            refusals[target] = str(exc)
            return None
        if client is None:
            refusals[target] = f"no credentials for {target.describe()}"
            return None
        clients[target] = client
    return clients[target]


def _settle(store: Store, entry_id: str) -> None:
    """Nothing is owed on the server any more: release and un-hold the record."""
    store.update_index(entry_id, {"remote_pending": None, "remote_error": None})
    store.release(entry_id)
