"""Where the operator's Google credentials may go when a *stored* GenAI record names the target.

A GenAI record's target (``base_url``, ``api_version``, the Vertex ``project`` and
``location``) is data from the store -- or from an archive imported into it -- and whoever
can write the store writes it. ``spoolctl clean --genai`` (run by cron with the operator's
API key or Google Cloud credentials) builds its client from that target, so the target
decides where ``x-goog-api-key`` or an OAuth token is sent. The rule:

* Google's own endpoints only, over https: no ``base_url`` (the SDK derives
  ``https://generativelanguage.googleapis.com`` or ``https://<location>-aiplatform.googleapis.com``),
  or an ``https`` URL on ``googleapis.com`` / ``*.googleapis.com`` (port 443, no user info);
* a Vertex ``location`` is part of the SDK's host name, so it must be a plain region name
  (``us-central1``, ``global``); ``project`` and ``api_version`` are path parts, so they
  must be plain names too;
* any other endpoint only when the OPERATOR allowed its origin explicitly: the
  ``SPOOLCTL_GENAI_ENDPOINTS`` environment variable (comma-separated
  ``scheme://host[:port]`` origins) or ``spoolctl clean --genai-endpoint ORIGIN``.
  Nothing read from a store or an archive can widen the list.

Base dependencies only (no google-genai import): the check runs before any client exists.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from spoolctl.store import ConfigError

from .records import GenaiRecord, GenaiTarget

ENDPOINTS_ENV = "SPOOLCTL_GENAI_ENDPOINTS"
"""Comma-separated origins (``http://127.0.0.1:8080``) the operator allows besides Google's."""

GOOGLE_DOMAIN = "googleapis.com"
_LOCATION_RE = re.compile(r"[a-z][a-z0-9-]{0,62}")  # a host-name label: `us-central1`, `global`
_PROJECT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:_-]{0,127}")  # ids, domain-scoped `ex.com:p`
_VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,31}")
_DEFAULT_PORTS = {"https": 443, "http": 80}


def origin_of(url: str) -> str | None:
    """``scheme://host:port`` (lower case, default port filled in) of an http(s) URL without
    user info, or None when ``url`` is not one."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname or "@" in parts.netloc:
        return None
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port or _DEFAULT_PORTS[scheme]}"


@dataclass(frozen=True)
class EndpointPolicy:
    """Google's endpoints over https, plus the origins the operator allowed (``allowed``)."""

    allowed: frozenset[str] = frozenset()

    @classmethod
    def from_operator(cls, extra: Iterable[str] = (),
                      environ: Mapping[str, str] | None = None) -> EndpointPolicy:
        """The policy from ``SPOOLCTL_GENAI_ENDPOINTS`` plus ``extra`` (command-line origins).

        ConfigError (one line, naming the variable or option) for an entry that is not a
        bare ``scheme://host[:port]`` origin: a path or user info there is a mistake."""
        env = os.environ if environ is None else environ
        given = [(ENDPOINTS_ENV, e) for e in (env.get(ENDPOINTS_ENV) or "").split(",")]
        given += [("--genai-endpoint", e) for e in extra]
        allowed = set()
        for where, entry in given:
            entry = entry.strip()
            if not entry:
                continue
            origin = origin_of(entry)
            path = urlsplit(entry).path if origin else ""
            if origin is None or path not in ("", "/") or urlsplit(entry).query:
                raise ConfigError(f"{where}: {entry[:80]!r} is not an http(s) origin",
                                  fix="give scheme://host[:port], e.g. http://127.0.0.1:8080")
            allowed.add(origin)
        return cls(frozenset(allowed))

    def refusal(self, target: GenaiTarget) -> str | None:
        """Why credentials must not be sent to ``target`` (one phrase), or None when they may."""
        if target.api_version is not None and not _VERSION_RE.fullmatch(target.api_version):
            return f"its api_version {target.api_version[:40]!r} is not a plain version name"
        if target.api == "vertex":
            if not _LOCATION_RE.fullmatch(target.location or ""):
                return (f"its Vertex location {(target.location or '')[:40]!r} is not a "
                        "region name (it becomes part of the host name)")
            if not _PROJECT_RE.fullmatch(target.project or ""):
                return f"its Vertex project {(target.project or '')[:40]!r} is not a project id"
        if target.base_url is None:
            return None  # the SDK's own Google endpoint, over https
        origin = origin_of(target.base_url)
        if origin is not None and origin in self.allowed:
            return None
        if origin is not None and origin.startswith("https://") and origin.endswith(":443"):
            host = origin[len("https://"):-len(":443")]
            if host == GOOGLE_DOMAIN or host.endswith("." + GOOGLE_DOMAIN):
                return None
        return (f"its base_url {target.base_url[:80]!r} is not a Google endpoint over https "
                f"and the operator did not allow it")

    def check(self, target: GenaiTarget, record: str) -> str | None:
        """``refusal`` as one line naming the record and the fix, or None."""
        why = self.refusal(target)
        if why is None:
            return None
        origin = origin_of(target.base_url or "") or "scheme://host:port"
        return (f"record {record[:16]}: credentials not sent: {why} (if you trust that "
                f"endpoint, allow it: {ENDPOINTS_ENV}={origin} or "
                f"`spoolctl clean --genai --genai-endpoint {origin}`; otherwise find who wrote "
                f"the record: the store's writer chose that address)")


_NAME_PARTS_RE = re.compile(r"(?:projects/(?P<project>[^/]+)/locations/(?P<location>[^/]+)/)?"
                            r"cachedContents/(?P<id>[A-Za-z0-9._-]+)")


def scoped_name(target: GenaiTarget, name: str) -> str:
    """``cachedContents/<id>`` of ``name``: the SDK completes it with the client's own
    project and location (those of ``target``), so a delete never leaves them."""
    m = _NAME_PARTS_RE.fullmatch(name)
    if m is None:
        raise ValueError(f"not a cachedContents name: {name[:80]!r}")
    return f"cachedContents/{m.group('id')}"


def name_refusal(target: GenaiTarget, name: str) -> str | None:
    """Why ``name`` is not a cache of ``target`` (one phrase), or None when it is one: a
    Gemini API cache has the short form; a full Vertex name must be in the target's location
    and project (or a project number: Vertex names projects by number, the SDK by id)."""
    m = _NAME_PARTS_RE.fullmatch(name)
    if m is None or m.group("id").strip(".") == "":
        return f"{name[:80]!r} is not a cachedContents name"
    if m.group("project") is None:
        return None
    if target.api != "vertex":
        return f"{name[:120]!r} names a Vertex AI cache, the record a Gemini API one"
    if m.group("location") != target.location:
        return f"{name[:120]!r} is in another location than the record's ({target.location})"
    if m.group("project") != target.project and not m.group("project").isdigit():
        return f"{name[:120]!r} is in another project than the record's ({target.project})"
    return None


def owned_name_refusal(record: GenaiRecord, row_name: object) -> str | None:
    """``name_refusal`` for the cache ``record`` (read from its manifest) names, and a
    catalog row that names another: one line naming the record and the fix, or None."""
    why = name_refusal(record.target, record.name)
    if why is None and row_name is not None and row_name != record.name:
        why = "its catalog row names another cache than its manifest (the row was edited)"
    if why is None:
        return None
    return (f"record {record.entry_id[:16]}: nothing deleted: {why}; find who wrote the "
            "record: the store's writer chose that name")
