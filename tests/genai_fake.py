"""A local fake of the Gemini API / Vertex AI ``cachedContents`` REST surface.

Stdlib only; serves on 127.0.0.1 and never touches the network. The real
``google-genai`` client is pointed at it with ``HttpOptions(base_url=...)``.

Implemented (both path shapes):

* Gemini API: ``/{ver}/cachedContents[/ID]`` and ``/{ver}/models/M:generateContent``,
  authenticated by the ``x-goog-api-key`` header.
* Vertex AI: ``/{ver}/projects/P/locations/L/cachedContents[/ID]`` and
  ``/{ver}/projects/P/locations/L/publishers/google/models/M:generateContent``,
  authenticated by ``Authorization: Bearer <token>``.

``POST`` create, ``GET`` get, ``GET`` list (paged), ``PATCH`` ttl/expireTime,
``DELETE``; ``generateContent`` with ``cachedContent`` reports
``usageMetadata.cachedContentTokenCount``. Errors use Google's JSON error shape:
400 invalid TTL / argument, 403 bad credentials or unknown cached content in a
generate call (as the real API does), 404 unknown resource, and any status
injected with ``fail_next`` (429, 500...).

Time comes from an injectable ``clock`` so tests can expire caches without
sleeping. Tokens are counted as whitespace-separated words (deterministic).
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

_TTL_RE = re.compile(r"([0-9]+(?:\.[0-9]{1,9})?)s")
_VERTEX_PREFIX = re.compile(r"projects/([^/]+)/locations/([^/]+)/")
STATUS_NAMES = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
    404: "NOT_FOUND", 409: "ALREADY_EXISTS", 429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL", 503: "UNAVAILABLE",
}


def rfc3339(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_rfc3339(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def count_tokens(value: Any) -> int:
    """Words in every ``text`` field (and tool declarations) of a JSON value."""
    if isinstance(value, dict):
        n = 0
        for k, v in value.items():
            if k == "text" and isinstance(v, str):
                n += len(v.split())
            elif k == "functionDeclarations":
                n += len(json.dumps(v, sort_keys=True).split())
            else:
                n += count_tokens(v)
        return n
    if isinstance(value, list):
        return sum(count_tokens(v) for v in value)
    return 0


class FakeClock:
    """A settable clock shared by the fake server and the code under test."""

    def __init__(self, start: float = 1_800_000_000.0):
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


@dataclass
class CachedResource:
    name: str
    model: str
    display_name: str
    create_time: float
    update_time: float
    expire_time: float
    token_count: int
    body: dict

    def to_json(self, *, full: bool = True) -> dict:
        doc = {
            "name": self.name, "model": self.model, "displayName": self.display_name,
            "createTime": rfc3339(self.create_time), "updateTime": rfc3339(self.update_time),
            "expireTime": rfc3339(self.expire_time),
            "usageMetadata": {"totalTokenCount": self.token_count},
        }
        if not self.display_name:
            del doc["displayName"]
        return doc


@dataclass
class Fault:
    status: int
    method: str | None
    path_re: re.Pattern[str] | None
    remaining: int
    message: str


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any
    headers: dict[str, str]


@dataclass
class FakeGenAIState:
    """Everything the fake knows; tests read it to check the server side."""

    api_key: str = "test-key"
    bearer_token: str = "test-token"
    min_cache_tokens: int = 0
    caches: dict[str, CachedResource] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    created: int = 0
    deleted: int = 0
    create_delay: float = 0.0
    # When set, creates wait for it (up to 30 s): tests hold a create open deterministically.
    create_gate: threading.Event | None = None


class FakeGenAIServer:
    """The fake REST server. Use as a context manager; ``base_url`` is where it listens.

    ``clock`` gives server time (caches past ``expireTime`` vanish, as on the real
    service). ``fail_next(status, method=..., path=..., times=n)`` makes the next
    matching requests fail with ``status``.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time, api_key: str = "test-key",
                 bearer_token: str = "test-token", min_cache_tokens: int = 0):
        self.clock = clock
        self.state = FakeGenAIState(api_key=api_key, bearer_token=bearer_token,
                                    min_cache_tokens=min_cache_tokens)
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> FakeGenAIServer:
        handler = type("Handler", (_Handler,), {"fake": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="fake-genai", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> FakeGenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        assert self._httpd is not None, "server not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    # -- test controls --------------------------------------------------------------------

    def fail_next(self, status: int, *, method: str | None = None, path: str | None = None,
                  times: int = 1, message: str | None = None) -> None:
        """Answer the next ``times`` requests matching ``method``/``path`` (a regex searched
        in the URL path) with an error of ``status``."""
        with self._lock:
            self.state.faults.append(Fault(
                status, method.upper() if method else None,
                re.compile(path) if path else None, times,
                message or f"injected {STATUS_NAMES.get(status, 'ERROR')} for a test"))

    def live_names(self) -> set[str]:
        with self._lock:
            self._expire()
            return set(self.state.caches)

    def requests(self, method: str | None = None, contains: str = "") -> list[Request]:
        with self._lock:
            return [r for r in self.state.requests
                    if (method is None or r.method == method) and contains in r.path]

    def _expire(self) -> None:
        now = self.clock()
        for name in [n for n, c in self.state.caches.items() if c.expire_time <= now]:
            del self.state.caches[name]

    # -- request handling (called by the handler thread) ---------------------------------------

    def handle(self, method: str, raw_path: str, headers: dict[str, str],
               body: Any) -> tuple[int, dict]:
        url = urlsplit(raw_path)
        query = parse_qs(url.query)
        with self._lock:
            self.state.requests.append(Request(method, url.path, query, body, headers))
        if method == "POST" and url.path.endswith("/cachedContents"):
            # Hold creates open (before any injected fault) so tests can pile up callers.
            if self.state.create_delay:
                time.sleep(self.state.create_delay)
            if self.state.create_gate is not None:
                self.state.create_gate.wait(30)
        with self._lock:
            fault = self._take_fault(method, url.path)
        if fault is not None:
            return _error(fault.status, fault.message)
        parts = url.path.strip("/").split("/", 1)
        if len(parts) != 2:
            return _error(404, f"unknown path {url.path}")
        _version, rest = parts
        scope = ""
        m = _VERTEX_PREFIX.match(rest)
        if m:
            scope = m.group(0)
            if headers.get("authorization") != f"Bearer {self.state.bearer_token}":
                return _error(401, "Request had invalid authentication credentials.")
            rest = rest[len(scope):]
        elif headers.get("x-goog-api-key") != self.state.api_key:
            return _error(403, "Method doesn't allow unregistered callers "
                               "(callers without established identity). Please use API Key.")
        if rest == "cachedContents":
            if method == "POST":
                return self._create(scope, body or {})
            if method == "GET":
                return self._list(scope, query)
        elif rest.startswith("cachedContents/"):
            name = scope + rest
            if method == "GET":
                return self._get(name)
            if method == "PATCH":
                return self._patch(name, body or {})
            if method == "DELETE":
                return self._delete(name)
        elif method == "POST" and rest.endswith(":generateContent"):
            model = rest[: -len(":generateContent")]
            return self._generate(scope, model, body or {})
        return _error(404, f"no route for {method} {url.path}")

    def _take_fault(self, method: str, path: str) -> Fault | None:
        for fault in self.state.faults:
            if fault.method not in (None, method):
                continue
            if fault.path_re is not None and not fault.path_re.search(path):
                continue
            fault.remaining -= 1
            if fault.remaining <= 0:
                self.state.faults.remove(fault)
            return fault
        return None

    def _ttl(self, body: dict, now: float) -> float | tuple[int, dict]:
        if "expireTime" in body:
            try:
                return parse_rfc3339(body["expireTime"])
            except (TypeError, ValueError):
                return _error(400, f"Invalid value at 'expire_time' ({body['expireTime']!r})")
        ttl = body.get("ttl", "3600s")
        m = _TTL_RE.fullmatch(ttl) if isinstance(ttl, str) else None
        if m is None or float(m.group(1)) <= 0:
            return _error(400, f"Invalid value at 'cached_content.ttl' ({ttl!r}): "
                               "Field 'ttl', Illegal duration format; duration must end with 's'")
        return now + float(m.group(1))

    def _create(self, scope: str, body: dict) -> tuple[int, dict]:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return _error(400, "model is required")
        if scope and not model.startswith(scope + "publishers/"):
            return _error(400, f"model {model!r} is not in {scope}")
        if not scope and not model.startswith("models/"):
            return _error(400, f"model {model!r} must start with 'models/'")
        now = self.clock()
        expire = self._ttl(body, now)
        if isinstance(expire, tuple):
            return expire
        tokens = count_tokens({k: body.get(k) for k in ("systemInstruction", "contents", "tools")})
        if tokens < self.state.min_cache_tokens:
            return _error(400, f"Cached content is too small. total_token_count={tokens}, "
                               f"min_total_token_count={self.state.min_cache_tokens}")
        with self._lock:
            name = f"{scope}cachedContents/fake{next(self._ids):06d}"
            res = CachedResource(name=name, model=model, display_name=body.get("displayName", ""),
                                 create_time=now, update_time=now, expire_time=expire,
                                 token_count=tokens, body=body)
            self.state.caches[name] = res
            self.state.created += 1
        return 200, res.to_json()

    def _lookup(self, name: str) -> CachedResource | tuple[int, dict]:
        with self._lock:
            self._expire()
            res = self.state.caches.get(name)
        if res is None:
            return _error(404, f"CachedContent not found (or permission denied): {name}")
        return res

    def _get(self, name: str) -> tuple[int, dict]:
        res = self._lookup(name)
        return res if isinstance(res, tuple) else (200, res.to_json())

    def _list(self, scope: str, query: dict[str, list[str]]) -> tuple[int, dict]:
        size = int(query.get("pageSize", ["2"])[0])
        start = int(query.get("pageToken", ["0"])[0] or 0)
        with self._lock:
            self._expire()
            names = sorted(n for n in self.state.caches if n.startswith(scope + "cachedContents/"))
            page = [self.state.caches[n].to_json() for n in names[start:start + size]]
        doc: dict[str, Any] = {"cachedContents": page} if page else {}
        if start + size < len(names):
            doc["nextPageToken"] = str(start + size)
        return 200, doc

    def _patch(self, name: str, body: dict) -> tuple[int, dict]:
        res = self._lookup(name)
        if isinstance(res, tuple):
            return res
        now = self.clock()
        expire = self._ttl(body, now)
        if isinstance(expire, tuple):
            return expire
        with self._lock:
            res.expire_time = expire
            res.update_time = now
        return 200, res.to_json()

    def _delete(self, name: str) -> tuple[int, dict]:
        res = self._lookup(name)
        if isinstance(res, tuple):
            return res
        with self._lock:
            self.state.caches.pop(name, None)
            self.state.deleted += 1
        return 200, {}

    def _generate(self, scope: str, model: str, body: dict) -> tuple[int, dict]:
        if scope and not model.startswith("publishers/google/models/"):
            return _error(404, f"Publisher model {model} not found")
        if not scope and not model.startswith("models/"):
            return _error(404, f"model {model} not found")
        contents = body.get("contents")
        if not contents:
            return _error(400, "* GenerateContentRequest.contents: contents is not specified")
        cached_tokens = 0
        cached_name = body.get("cachedContent")
        if cached_name is not None:
            with self._lock:
                self._expire()
                res = self.state.caches.get(cached_name)
            if res is None:
                # The real service answers 403 for a missing cache in a generate call.
                return _error(403, f"CachedContent not found (or permission denied): "
                                   f"{cached_name}")
            if res.model != scope + model:
                return _error(400, f"Model used by GenerateContent request ({scope + model}) "
                                   f"and CachedContent ({res.model}) has to be the same.")
            if any(k in body for k in ("systemInstruction", "tools", "toolConfig")):
                return _error(400, "CachedContent can not be used with GenerateContent request "
                                   "setting system_instruction, tools or tool_config.")
            cached_tokens = res.token_count
        fresh = count_tokens({k: body.get(k) for k in ("systemInstruction", "contents", "tools")})
        reply = f"ok cached={cached_tokens} fresh={fresh}"
        usage: dict[str, int] = {
            "promptTokenCount": cached_tokens + fresh,
            "candidatesTokenCount": len(reply.split()),
            "totalTokenCount": cached_tokens + fresh + len(reply.split()),
        }
        if cached_tokens:
            usage["cachedContentTokenCount"] = cached_tokens
        return 200, {
            "candidates": [{"content": {"role": "model", "parts": [{"text": reply}]},
                            "finishReason": "STOP", "index": 0}],
            "usageMetadata": usage,
            "modelVersion": model.rsplit("/", 1)[-1],
        }


def _error(status: int, message: str) -> tuple[int, dict]:
    return status, {"error": {"code": status, "message": message,
                              "status": STATUS_NAMES.get(status, "UNKNOWN")}}


class _Handler(BaseHTTPRequestHandler):
    fake: FakeGenAIServer
    # Without this every response waits for the peer's delayed ACK (~45 ms a request).
    disable_nagle_algorithm = True
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet under pytest
        pass

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            status, doc = _error(400, "request body is not JSON")
        else:
            headers = {k.lower(): v for k, v in self.headers.items()}
            try:
                status, doc = self.fake.handle(self.command, self.path, headers, body)
            except Exception as exc:  # a bug in the fake must surface, not hang the client
                status, doc = _error(500, f"fake server bug: {exc!r}")
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = do_DELETE = _serve


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Fail any test that resolves a host other than the loopback fake: a refusal or the fake
    must answer first. Import it into a test module to apply it there (autouse)."""
    real = socket.getaddrinfo

    def local_only(host, *args, **kwargs):
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise AssertionError(f"test tried to reach {host!r}")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", local_only)
