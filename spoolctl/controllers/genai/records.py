"""Pure logic of the Google GenAI cache controller: no google-genai import, no I/O.

* ``parse_ttl``: the one accepted TTL form, ``"<seconds>s"``.
* ``GenaiTarget``: which API a cache lives on (Gemini API, or Vertex AI project +
  location, plus a custom base URL) and the store namespace derived from it.
* ``GenaiRecord``: one server-side cache as the spool store records it, and how
  it maps to manifest ``meta`` / ``index`` and back.
* ``cache_request`` / ``generate_request``: ``CachePrepareParams`` turned into the
  dict forms the SDK accepts for ``caches.create`` and ``generate_content``.
* ``remote_error``: an SDK/transport exception turned into one SpoolError line.
* ``genai_status``: the rows ``spoolctl status`` shows for genai entries.
* ``index_problem`` / ``from_manifest``: a record is read field by field; a value the
  helpers cannot use raises ``MalformedRow`` (the store's "bad row", a ValueError) naming
  it, so every job skips that one record, reports it and goes on.

Store mapping: one entry per server resource, ``kind="genai"``, ``namespace =
target.namespace()``, ``key = "<controller key>/<resource name>"`` (so a cache
recreated for the same parameters never collides with the record of an old one
whose server delete is still pending), no payload objects. The catalog ``index``
carries the mutable facts: ``expire_time`` (moved by a TTL update),
``remote_pending`` (server delete still owed; local cleanup skips the entry) and
``remote_error`` (the last failure, for ``status``).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeGuard

from spoolctl.errors import (
    BusyError,
    ConfigError,
    InvalidIdError,
    NotFoundError,
    SpoolError,
)
from spoolctl.store import MAX_KEY_LEN, MalformedRow, hash_parts

from ..contract import CachePrepareParams, Element, Includes

if TYPE_CHECKING:
    from spoolctl.store import CatalogRow, Manifest, Store

KIND = "genai"
DEFAULT_TTL = "3600s"
_TTL_RE = re.compile(r"([0-9]{1,12})(\.[0-9]{1,9})?s")
_NAME_RE = re.compile(
    r"(?:projects/[A-Za-z0-9._-]+/locations/[A-Za-z0-9._-]+/)?cachedContents/[A-Za-z0-9._-]+")
MAX_ERROR_CHARS = 300


class RemoteServiceError(SpoolError):
    """The hosted cache service failed (5xx, timeout, connection refused): retry later."""


def parse_ttl(ttl: str) -> float:
    """Seconds of a TTL written ``"<seconds>s"`` (``"3600s"``, ``"90.5s"``); > 0.

    Anything else (an int, ``"1h"``, ``"-5s"``, ``"0s"``) raises ConfigError.
    """
    m = _TTL_RE.fullmatch(ttl) if isinstance(ttl, str) else None
    if m is None or float(ttl[:-1]) <= 0:
        raise ConfigError(f"invalid cache TTL {ttl!r}",
                          fix='write the TTL as a positive number of seconds followed by "s", '
                              'e.g. "3600s"')
    return float(ttl[:-1])


def validate_name(name: str) -> str:
    """A cachedContents resource name (short Gemini form or full Vertex form)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidIdError(f"invalid cached content name {str(name)[:120]!r}",
                             fix="pass the name returned by prepare(), e.g. "
                                 "'cachedContents/abc123'")
    return name


def to_unix(value: dt.datetime | str | float | int | None) -> float | None:
    """A server timestamp (datetime or RFC 3339 text) as unix seconds."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.timezone.utc)
    return value.timestamp()


@dataclass(frozen=True)
class GenaiTarget:
    """Where a cache lives. ``base_url`` is set only when it is not Google's default."""

    api: Literal["gemini", "vertex"]
    project: str | None = None
    location: str | None = None
    base_url: str | None = None
    api_version: str | None = None

    def __post_init__(self) -> None:
        if self.api not in ("gemini", "vertex"):
            raise ConfigError(f"unknown genai api {self.api!r}", fix="use 'gemini' or 'vertex'")
        if self.api == "vertex" and not (self.project and self.location):
            raise ConfigError("a Vertex AI client needs a project and a location",
                              fix="create it as genai.Client(vertexai=True, project=..., "
                                  "location=...)")

    def namespace(self) -> str:
        """The store namespace: api shape plus a digest of project, location and URL."""
        digest = hash_parts(b"spoolctl-genai-ns/v1", self.api.encode(),
                            (self.project or "").encode(), (self.location or "").encode(),
                            (self.base_url or "").encode())
        return f"{self.api}-{digest[:24]}"

    def describe(self) -> str:
        where = "Gemini API" if self.api == "gemini" else \
            f"Vertex AI ({self.project}/{self.location})"
        return f"{where} at {self.base_url}" if self.base_url else where

    def to_json(self) -> dict[str, Any]:
        return {"api": self.api, "project": self.project, "location": self.location,
                "base_url": self.base_url, "api_version": self.api_version}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> GenaiTarget:
        """The target a record names; ConfigError for a value that is not what
        ``to_json`` writes (text or null)."""
        if not isinstance(doc, Mapping):
            raise ConfigError("a genai target is not an object", fix="see docs/format.md")
        fields = {k: doc.get(k) for k in ("project", "location", "base_url", "api_version")}
        api = doc.get("api", "gemini")
        bad = sorted(k for k, v in {**fields, "api": api}.items()
                     if v is not None and not isinstance(v, str))
        if bad:
            raise ConfigError(f"genai target {bad[0]} is not text", fix="see docs/format.md")
        return cls(api, **fields)  # __post_init__ rejects an unknown api


@dataclass(frozen=True)
class GenaiRecord:
    """One server-side cache as recorded in the store."""

    entry_id: str
    name: str
    model: str
    key: str
    display_name: str
    create_time: float
    expire_time: float
    token_count: int
    includes: Includes
    target: GenaiTarget
    hint: str = "retain"
    remote_pending: bool = False
    remote_error: str | None = None

    def remaining(self, now: float) -> float:
        return self.expire_time - now

    def state(self, now: float) -> str:
        """live | expired | delete-pending | released."""
        if self.remote_pending:
            return "expired" if now >= self.expire_time else "delete-pending"
        if self.hint == "release":
            return "released"
        return "expired" if now >= self.expire_time else "live"

    def store_key(self) -> str:
        return store_key(self.key, self.name)

    def meta(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model, "display_name": self.display_name,
                "create_time": self.create_time, "expire_time": self.expire_time,
                "token_count": self.token_count, "key": self.key,
                "includes": self.includes.to_json(), "target": self.target.to_json()}

    def index(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model, "expire_time": self.expire_time,
                "key": self.key, "token_count": self.token_count,
                "display_name": self.display_name}

    @classmethod
    def from_manifest(cls, manifest: Manifest, row: CatalogRow | None = None) -> GenaiRecord:
        """Rebuild from a manifest; the catalog row (when given) supplies mutable facts.

        Raises MalformedRow naming the first value that is not what ``meta()``/``index()``
        write (a record edited by hand or written by another tool): callers skip that
        record and report it."""
        meta = manifest.meta
        index = dict(row.index) if row is not None else dict(manifest.index)
        entry_id = manifest.entry_id
        problem = index_problem(index)
        if problem is not None:
            raise MalformedRow(entry_id, problem)
        name = meta.get("name")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise MalformedRow(entry_id, "meta name is not a cachedContents name")
        for field_name in ("model", "key", "display_name"):
            if not isinstance(meta.get(field_name, ""), str):
                raise MalformedRow(entry_id, f"meta {field_name} is not text")
        create = meta.get("create_time", manifest.created)
        expire = index.get("expire_time", meta.get("expire_time", 0.0))
        if not _is_number(create) or not _is_number(expire if expire is not None else 0.0):
            raise MalformedRow(entry_id, "meta create_time or expire_time is not a number")
        tokens = meta.get("token_count", 0)
        inc = meta.get("includes") or {}
        if not _is_count(tokens):
            raise MalformedRow(entry_id, "meta token_count is not a count")
        if not isinstance(inc, Mapping) or not _is_count(inc.get("data_element_count", 0)):
            raise MalformedRow(entry_id, "meta includes is not what spoolctl writes")
        try:
            target = GenaiTarget.from_json(meta.get("target") or {})
        except ConfigError as exc:
            raise MalformedRow(entry_id, exc.message) from None
        return cls(
            entry_id=entry_id, name=name, model=meta.get("model", ""),
            key=meta.get("key", ""), display_name=meta.get("display_name", ""),
            create_time=float(create), expire_time=float(expire or 0.0),
            token_count=int(tokens),
            includes=Includes(instructions=bool(inc.get("instructions", False)),
                              data_element_count=int(inc.get("data_element_count", 0)),
                              tools=bool(inc.get("tools", False))),
            target=target,
            hint=row.hint if row is not None else "retain",
            remote_pending=bool(index.get("remote_pending", False)),
            remote_error=index.get("remote_error"),
        )


def _is_number(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def index_problems(index: Any) -> dict[str, str]:
    """The fields of a genai catalog ``index`` the GenAI helpers cannot use, with why
    (empty if they can use it all; ``"*"`` if it is not an object at all).

    Missing fields are fine (defaults); a field that is present must have the type
    ``GenaiRecord.index()`` writes -- the store itself checks only the facts it
    interprets (``expire_time``, ``remote_pending``)."""
    if not isinstance(index, Mapping):
        return {"*": "index is not an object"}
    out: dict[str, str] = {}
    name = index.get("name")
    if name is not None and not (isinstance(name, str) and _NAME_RE.fullmatch(name)):
        out["name"] = "index name is not a cachedContents name"
    expire = index.get("expire_time")
    if expire is not None and not _is_number(expire):
        out["expire_time"] = "index expire_time is not a number"
    pending = index.get("remote_pending")
    if pending is not None and not isinstance(pending, bool):
        out["remote_pending"] = "index remote_pending is not true or false"
    tokens = index.get("token_count")
    if tokens is not None and not _is_count(tokens):
        out["token_count"] = "index token_count is not a count"
    for field_name in TEXT_FIELDS:
        value = index.get(field_name)
        if value is not None and not isinstance(value, str):
            out[field_name] = f"index {field_name} is not text"
    return out


TEXT_FIELDS = ("model", "key", "display_name", "remote_error")


def index_problem(index: Any) -> str | None:
    """The first of ``index_problems`` (None if the GenAI helpers can read ``index``)."""
    problems = index_problems(index)
    return next(iter(problems.values()), None)


def expire_of(index: Mapping[str, Any]) -> float:
    """The recorded expiry (unix seconds) of a well-formed index; 0 (expired) if absent."""
    value = index.get("expire_time")
    return float(value) if _is_number(value) else 0.0


def store_key(controller_key: str, name: str) -> str:
    key = f"{controller_key}/{name}"
    if len(key) > MAX_KEY_LEN:
        raise InvalidIdError("cached content name too long to record",
                             fix="report this: the server returned an unexpected name")
    return key


# -- request building -----------------------------------------------------------------------

def _role(e: Element) -> str:
    return "model" if e.role in ("assistant", "model") else "user"


def contents_of(elements: Sequence[Element]) -> list[dict[str, Any]]:
    """Gemini ``contents``: one Content per element (assistant/model -> "model")."""
    return [{"role": _role(e), "parts": [{"text": e.content}]} for e in elements]


def system_instruction_of(elements: Sequence[Element]) -> dict[str, Any]:
    return {"parts": [{"text": e.content} for e in elements]}


def tools_of(params: CachePrepareParams) -> list[dict[str, Any]]:
    decls = []
    for t in sorted(params.tools, key=lambda t: t.name):
        decl: dict[str, Any] = {"name": t.name}
        if t.description:
            decl["description"] = t.description
        if t.parameters:
            decl["parameters"] = json.loads(json.dumps(dict(t.parameters)))
        decls.append(decl)
    return [{"function_declarations": decls}]


def cache_request(params: CachePrepareParams) -> dict[str, Any] | None:
    """The ``CreateCachedContentConfig`` fields (dict form) for the cacheable prefix of
    ``params``, or None when nothing can be cached.

    Gemini keeps the system instruction apart from ``contents`` and refuses a
    generate request that sets ``system_instruction`` or ``tools`` next to a cache,
    so a prefix that holds only part of the instructions (a volatile instruction)
    cannot be cached at all: None, and the caller runs cold.
    """
    instr, data = params.cacheable()
    if len(instr) != len(params.instructions):
        return None
    if not (instr or data or params.tools):
        return None
    req: dict[str, Any] = {}
    if instr:
        req["system_instruction"] = system_instruction_of(instr)
    if data:
        req["contents"] = contents_of(data)
    if params.tools:
        req["tools"] = tools_of(params)
    return req


def generate_request(
    params: CachePrepareParams, includes: Includes | None, query: Sequence[Element],
    config: Mapping[str, Any] | None = None, cached_content: str | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(contents, config) for ``generate_content``: everything the cache does not
    already hold, per ``includes``, then the ``query`` elements."""
    inc = includes or Includes()
    cfg = dict(config or {})
    if cached_content is not None:
        clash = [k for k in ("system_instruction", "tools", "tool_config", "cached_content")
                 if cfg.get(k) is not None]
        if clash:
            raise ConfigError(f"config sets {', '.join(clash)} next to a cached content",
                              fix="leave them out: the cache already holds them")
        cfg["cached_content"] = cached_content
    if params.instructions and not (cached_content and inc.instructions):
        cfg["system_instruction"] = system_instruction_of(params.instructions)
    if params.tools and not (cached_content and inc.tools):
        cfg["tools"] = tools_of(params)
    skip = inc.data_element_count if cached_content else 0
    contents = contents_of([*params.data[skip:], *query])
    if not contents:
        raise ConfigError("nothing to send: the cache holds the whole prompt and no query "
                          "was given", fix="pass the user's query to generate()")
    return contents, cfg


# -- errors -----------------------------------------------------------------------------------

def _one_line(text: object) -> str:
    return " ".join(str(text).split())[:MAX_ERROR_CHARS]


def remote_error(exc: BaseException, action: str, where: str) -> SpoolError:
    """One SpoolError for a failed request: 400 -> ConfigError, 401/403 -> ConfigError
    (credentials), 404 -> NotFoundError, 429 -> BusyError, 5xx/transport ->
    RemoteServiceError. ``code`` and ``status`` are kept on the error."""
    code = getattr(exc, "code", None)
    code = code if isinstance(code, int) else None
    status = getattr(exc, "status", None)
    message = _one_line(getattr(exc, "message", None) or exc)
    head = f"{action} failed on {where}"
    detail = f" ({code} {status}: {message})" if code else f" ({type(exc).__name__}: {message})"
    err = _http_error(code, head + detail)
    err.code = code
    err.status = status
    return err


def _http_error(code: int | None, text: str) -> SpoolError:
    """The spoolctl error class of an HTTP status ``code`` (None: transport failure)."""
    if code == 400:
        return ConfigError(text, fix="fix the request (model name, TTL, contents)")
    if code in (401, 403):
        return ConfigError(text, fix="check the API key / credentials and their permissions")
    if code == 404:
        return NotFoundError(text, fix="the cache is gone on the server; "
                                        "prepare() creates a new one")
    if code == 429:
        return BusyError(text, fix="quota exhausted or rate limited: retry later")
    return RemoteServiceError(text, fix="the service failed; retry later "
                                        "(`spoolctl clean --genai` retries pending deletes)")


# -- status ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GenaiStatusRow:
    """One genai entry for ``spoolctl status``: what, where, and time to expiry."""

    entry_id: str
    name: str
    model: str
    display_name: str
    namespace: str
    state: str
    expires_in: float
    token_count: int
    remote_error: str | None

    def to_json(self) -> dict[str, Any]:
        return {"entry_id": self.entry_id, "name": self.name, "model": self.model,
                "display_name": self.display_name, "namespace": self.namespace,
                "state": self.state, "expires_in_s": round(self.expires_in, 1),
                "token_count": self.token_count, "remote_error": self.remote_error}


def status_of_row(row: CatalogRow, now: float) -> GenaiStatusRow:
    """Status from the catalog row alone (no manifest read); MalformedRow if a value is
    not what spoolctl writes (``index_problem``)."""
    index = row.index
    problem = index_problem(index)
    if problem is not None:
        raise MalformedRow(row.entry_id, problem)
    expire = expire_of(index)
    pending = bool(index.get("remote_pending", False))
    if pending:
        state = "expired" if now >= expire else "delete-pending"
    elif row.hint == "release":
        state = "released"
    else:
        state = "expired" if now >= expire else "live"
    return GenaiStatusRow(
        entry_id=row.entry_id, name=index.get("name") or "?", model=index.get("model") or "",
        display_name=index.get("display_name") or "", namespace=row.namespace, state=state,
        expires_in=expire - now, token_count=index.get("token_count") or 0,
        remote_error=index.get("remote_error"))


def genai_status(store: Store, now: float | None = None,
                 malformed: list[MalformedRow] | None = None) -> list[GenaiStatusRow]:
    """Every genai entry of ``store`` with its state and seconds to expiry (soonest first).
    A record that cannot be read is skipped (appended to ``malformed`` when given)."""
    import time

    now = time.time() if now is None else now
    rows = []
    for r in store.entries(kind=KIND, sort="age"):
        try:
            rows.append(status_of_row(r, now))
        except MalformedRow as exc:
            if malformed is not None:
                malformed.append(exc)
    return sorted(rows, key=lambda r: r.expires_in)


def pending_remote_deletes(store: Store, now: float | None = None) -> list[GenaiStatusRow]:
    """Released genai caches still owed a server delete (what a clean without
    ``--genai`` or without credentials leaves behind, and should say so)."""
    return [r for r in genai_status(store, now) if r.state == "delete-pending"]


def format_expiry(seconds: float) -> str:
    """``"in 59m 12s"`` / ``"expired 3m ago"``: for tables."""
    s = int(abs(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    text = f"{h}h {m:02d}m" if h else (f"{m}m {sec:02d}s" if m else f"{sec}s")
    return f"in {text}" if seconds > 0 else f"expired {text} ago"


# -- expiry (what ``spoolctl status`` / ``ls`` / ``inspect`` show) ------------------------------


def expires_in(index: Mapping[str, Any], now: float) -> float | None:
    """Seconds until the server-side cache a genai index records expires (negative: expired);
    None if the index holds no numeric ``expire_time``."""
    value = index.get("expire_time") if isinstance(index, Mapping) else None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    return float(value) - now


@dataclass(frozen=True)
class GenaiExpiry:
    """How many genai entries a store records, how many have expired, and the next expiry."""

    entries: int = 0
    expired: int = 0
    next_expiry_in_s: float | None = None
    malformed: int = 0  # records the GenAI helpers cannot read (``index_problem``)

    def to_json(self) -> dict[str, Any]:
        return {"entries": self.entries, "expired": self.expired,
                "next_expiry_in_s": self.next_expiry_in_s, "malformed": self.malformed}


def expiry_summary(rows: Sequence[CatalogRow], now: float) -> GenaiExpiry:
    """Summarise the expiry of ``rows`` (genai catalog rows; those without a valid
    ``expire_time`` count as entries only) and count the records the GenAI helpers
    would skip as malformed."""
    left = [e for e in (expires_in(r.index, now) for r in rows) if e is not None]
    return GenaiExpiry(entries=len(rows), expired=sum(1 for e in left if e <= 0),
                       next_expiry_in_s=min((e for e in left if e > 0), default=None),
                       malformed=sum(1 for r in rows if index_problem(r.index) is not None))
