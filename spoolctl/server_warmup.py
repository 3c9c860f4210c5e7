"""Warm a running vLLM server from a list of prompts (``spoolctl prefill --server``).

One-token greedy requests go to the server's OpenAI-compatible completions endpoint
(``POST /v1/completions``, ``max_tokens: 1``), so the server prefills each prompt (and the
spoolctl connector stores its chunks, or restores them if a peer's archive was imported).
Requests run on ``concurrency`` threads, each with its own keep-alive connection, their
starts spaced by a shared rate limit; transient failures (connection errors, 429, 502,
503, 504) are retried with backoff. For every prompt the report keeps what the server said:
prompt tokens and, when the server runs with ``--enable-prompt-tokens-details``, how many of
them were cached (restored or in its prefix cache) versus computed.

Only the standard library is used (``http.client``); nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from spoolctl.errors import ConfigError

MAX_PROMPTS_FILE = 256 << 20
MAX_RESPONSE = 16 << 20
RETRY_STATUS = frozenset({429, 502, 503, 504})
API_KEY_ENV = "VLLM_API_KEY"  # what vLLM's own server reads for --api-key


@dataclass(frozen=True)
class WarmPrompt:
    """One prompt: text or token ids, an optional cache salt, a name for the report."""

    name: str
    prompt: str | tuple[int, ...]
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.prompt, str):
            if not self.prompt:
                raise ValueError("empty prompt")
        elif not self.prompt or not all(isinstance(t, int) and not isinstance(t, bool)
                                        and t >= 0 for t in self.prompt):
            raise ValueError("token prompts are non-empty lists of non-negative integers")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not self.cache_salt):
            raise ValueError("cache_salt must be a non-empty string")


def parse_prompt_line(line: str, number: int) -> WarmPrompt:
    """One JSON Lines record: a string, a list of token ids, or an object with ``prompt``
    (and optional ``name``, ``cache_salt``). ValueError says what is wrong."""
    doc = json.loads(line)
    name = f"#{number}"
    salt = None
    if isinstance(doc, dict):
        unknown = set(doc) - {"prompt", "name", "cache_salt"}
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}")
        if "prompt" not in doc:
            raise ValueError('an object needs a "prompt"')
        name = str(doc.get("name") or name)[:200]
        salt = doc.get("cache_salt")
        doc = doc["prompt"]
    if isinstance(doc, list):
        return WarmPrompt(name, tuple(doc), salt)
    if isinstance(doc, str):
        return WarmPrompt(name, doc, salt)
    raise ValueError("a prompt is a JSON string, a list of token ids or an object")


def load_prompts(lines: Iterable[str], source: str) -> list[WarmPrompt]:
    """Parse a JSON Lines prompt file (blank lines are skipped)."""
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(parse_prompt_line(line, number))
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"line {number} of the prompts file is not a prompt "
                              f"({str(exc)[:120]})", path=source,
                              fix='write one JSON value per line: "text", [token ids] or '
                                  '{"prompt": ..., "cache_salt": ...}') from None
    if not out:
        raise ConfigError("the prompts file holds no prompt", path=source,
                          fix="write one JSON prompt per line")
    return out


def read_prompts_file(path: str) -> list[WarmPrompt]:
    """``path`` (``-`` = stdin) as prompts; ConfigError naming the file on any problem."""
    import sys

    if path == "-":
        return load_prompts(sys.stdin.read(MAX_PROMPTS_FILE + 1).splitlines(), "-")
    p = Path(path).expanduser()
    try:
        with open(p, encoding="utf-8") as f:
            text = f.read(MAX_PROMPTS_FILE + 1)
    except FileNotFoundError:
        raise ConfigError("prompts file not found", path=p, fix="check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the prompts file: {exc}", path=p,
                          fix="pass a readable UTF-8 JSON Lines file") from None
    if len(text) > MAX_PROMPTS_FILE:
        raise ConfigError("the prompts file is larger than 256 MiB", path=p,
                          fix="split it and warm in several runs")
    return load_prompts(text.splitlines(), str(p))


class RateLimiter:
    """Spaces request starts at least ``1/rate`` seconds apart (shared by all threads)."""

    def __init__(self, rate: float | None, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if rate is not None and rate <= 0:
            raise ConfigError("the rate must be positive", fix="e.g. --rate 20 (requests/s)")
        self._interval = 1.0 / rate if rate else 0.0
        self._clock, self._sleep = clock, sleep
        self._next = 0.0
        self._lock = threading.Lock()

    def wait(self) -> None:
        if not self._interval:
            return
        with self._lock:
            now = self._clock()
            start = max(now, self._next)
            self._next = start + self._interval
        if start > now:
            self._sleep(start - now)


@dataclass(frozen=True)
class Server:
    """Where the completions endpoint is: ``http(s)://host[:port][/prefix]`` (``/v1`` is
    appended unless the URL already ends with it)."""

    scheme: str
    host: str
    port: int
    base: str

    @classmethod
    def parse(cls, url: str) -> Server:
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"invalid server URL {url[:120]!r}",
                              fix="pass the server's base URL, e.g. http://127.0.0.1:8000")
        if parts.query or parts.fragment or parts.username:
            raise ConfigError("the server URL must not carry a query, fragment or user",
                              fix="pass http(s)://host:port[/prefix]; the API key comes from "
                                  f"${API_KEY_ENV}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise ConfigError(f"invalid port in {url[:120]!r}", fix="e.g. :8000") from None
        path = parts.path.rstrip("/")
        if not path.endswith("/v1"):
            path += "/v1"
        return cls(parts.scheme, parts.hostname, port, path)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.base}"


class ServerError(Exception):
    """A request failed: ``status`` (None for a connection error) and the server's text."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

    @property
    def transient(self) -> bool:
        return self.status is None or self.status in RETRY_STATUS


class Client:
    """A keep-alive HTTP connection per thread to ``server``."""

    def __init__(self, server: Server, *, timeout: float, api_key: str | None = None):
        self.server = server
        self.timeout = timeout
        self.api_key = api_key
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self.server.scheme == "https" \
                else http.client.HTTPConnection
            conn = cls(self.server.host, self.server.port, timeout=self.timeout)
            self._local.conn = conn
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One JSON request; the decoded JSON answer, or ServerError."""
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            conn = self._conn()
            conn.request(method, self.server.base + path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read(MAX_RESPONSE + 1)
        except (OSError, http.client.HTTPException) as exc:
            self._drop()
            what = "timed out" if isinstance(exc, (socket.timeout, TimeoutError)) else \
                (os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno else
                 type(exc).__name__)
            raise ServerError(f"connection to {self.server.host}:{self.server.port} failed: "
                              f"{what}") from None
        if resp.will_close:
            self._drop()
        if resp.status != 200:
            raise ServerError(f"HTTP {resp.status}: {_error_text(raw)}", resp.status)
        if len(raw) > MAX_RESPONSE:
            raise ServerError("the response is larger than 16 MiB", resp.status)
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: hostile nesting
            raise ServerError("the response is not JSON", resp.status) from None


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _error_text(raw: bytes) -> str:
    """The server's error message (OpenAI-style ``{"error": {"message"}}``): bounded, and
    control characters (terminal escapes, newlines) shown escaped -- it is data."""
    text = None
    with contextlib.suppress(ValueError, AttributeError, TypeError, RecursionError):
        doc = json.loads(raw)
        err = doc.get("error", doc)
        msg = err.get("message") if isinstance(err, dict) else err
        if msg:
            text = str(msg)
    if text is None:
        text = raw[:300].decode("utf-8", "replace").strip() or "(no body)"
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text[:300])


def served_models(client: Client) -> list[str]:
    doc = client.request("GET", "/models")
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ServerError("GET /v1/models did not return a model list")
    return [str(m.get("id")) for m in data if isinstance(m, dict) and m.get("id")]


@dataclass
class PromptResult:
    """What the server reported for one prompt (``error`` set when it failed)."""

    name: str
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    seconds: float = 0.0
    attempts: int = 0
    error: str | None = None
    status: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def computed_tokens(self) -> int | None:
        if self.prompt_tokens is None or self.cached_tokens is None:
            return None
        return self.prompt_tokens - self.cached_tokens

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "computed_tokens": self.computed_tokens,
                "seconds": round(self.seconds, 4), "attempts": self.attempts,
                "status": self.status, "error": self.error}


@dataclass
class WarmReport:
    server: str
    model: str
    results: list[PromptResult] = field(default_factory=list)
    seconds: float = 0.0
    concurrency: int = 1
    rate: float | None = None
    # Set when a signal stopped the warm-up: the prompts never sent, and those sent whose
    # answer was not waited for.
    interrupted: BaseException | None = None
    not_sent: int = 0
    abandoned: int = 0

    @property
    def failed(self) -> int:
        return sum(not r.ok for r in self.results)

    def to_json(self) -> dict[str, Any]:
        ok = [r for r in self.results if r.ok]
        known = [r for r in ok if r.cached_tokens is not None]
        return {
            "server": self.server, "model": self.model, "prompts": len(self.results),
            "ok": len(ok), "failed": self.failed, "seconds": round(self.seconds, 4),
            "concurrency": self.concurrency, "rate": self.rate,
            "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
            "cached_tokens": sum(r.cached_tokens or 0 for r in known) if known else None,
            "computed_tokens": sum(r.computed_tokens or 0 for r in known) if known else None,
            "cached_reported": len(known) == len(ok) and bool(ok),
            "interrupted": self.interrupted is not None,
            "not_sent": self.not_sent, "abandoned": self.abandoned,
            "results": [r.to_json() for r in self.results],
        }


def _count(value: Any) -> int | None:
    """A token count as the server reported it: a non-negative integer (not a bool)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 53
    return value if ok else None


def _parse_usage(doc: Any) -> tuple[int, int | None]:
    """(prompt tokens, cached tokens or None). A cached count that is not a count or
    exceeds the prompt is not believed (None: shown as n/a), never a negative computed."""
    usage = doc.get("usage") if isinstance(doc, dict) else None
    prompt = _count(usage.get("prompt_tokens")) if isinstance(usage, dict) else None
    if prompt is None or not isinstance(usage, dict):
        raise ServerError("the response has no usage.prompt_tokens", 200)
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return prompt, cached if cached is not None and cached <= prompt else None


def warm_one(client: Client, model: str, p: WarmPrompt, limiter: RateLimiter, *,
             retries: int, sleep: Callable[[float], Any] = time.sleep,
             stop: threading.Event | None = None) -> PromptResult:
    """Send one one-token request (retrying transient failures); never raises. No retry
    starts once ``stop`` is set."""
    body: dict[str, Any] = {"model": model, "prompt": p.prompt if isinstance(p.prompt, str)
                            else list(p.prompt), "max_tokens": 1, "temperature": 0.0,
                            "stream": False}
    if p.cache_salt is not None:
        body["cache_salt"] = p.cache_salt
    result = PromptResult(p.name)
    started = time.perf_counter()
    for attempt in range(retries + 1):
        limiter.wait()
        if stop is not None and stop.is_set() and attempt:
            break
        result.attempts = attempt + 1
        try:
            result.prompt_tokens, result.cached_tokens = _parse_usage(
                client.request("POST", "/completions", body))
            result.error, result.status = None, 200
            break
        except ServerError as exc:
            result.error, result.status = str(exc), exc.status
            if not exc.transient or attempt == retries:
                break
            sleep(min(8.0, 0.5 * 2 ** attempt))
    result.seconds = time.perf_counter() - started
    return result


def warm(client: Client, model: str, prompts: list[WarmPrompt], *, concurrency: int = 4,
         rate: float | None = None, retries: int = 3,
         progress: Callable[[PromptResult], None] | None = None) -> WarmReport:
    """Prefill every prompt on the server (at most ``concurrency`` in flight, at most
    ``rate`` request starts per second); results in prompt order.

    Interruptible: a ``KeyboardInterrupt`` (Ctrl-C, or SIGTERM as the CLI maps it) in the
    calling thread stops at once -- no further prompt is sent, the requests in flight are
    abandoned (not waited for: one can take minutes) -- and the report of what finished is
    returned with ``interrupted`` set to the exception (the caller decides the exit code).
    The senders are daemon threads for that reason: a pool would be joined at exit."""
    if concurrency < 1:
        raise ConfigError("concurrency must be at least 1", fix="e.g. --concurrency 4")
    limiter = RateLimiter(rate)
    report = WarmReport(client.server.url, model, concurrency=concurrency, rate=rate)
    started = time.perf_counter()
    results: list[PromptResult | None] = [None] * len(prompts)
    stop = threading.Event()
    lock = threading.Lock()
    todo = iter(range(len(prompts)))
    sent: set[int] = set()

    def sender() -> None:
        while not stop.is_set():
            with lock:
                i = next(todo, None)
                if i is None:
                    return
                sent.add(i)
            result = warm_one(client, model, prompts[i], limiter, retries=retries,
                              sleep=stop.wait, stop=stop)
            if stop.is_set():
                return  # interrupted meanwhile: the report is already taken
            results[i] = result
            if progress is not None:
                progress(result)

    threads = [threading.Thread(target=sender, name=f"spoolctl-warm-{n}", daemon=True)
               for n in range(min(concurrency, len(prompts)))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # interruptible by SIGINT on POSIX (lock acquisition)
    except KeyboardInterrupt as exc:
        stop.set()
        with lock:
            report.interrupted = exc
            report.not_sent = len(prompts) - len(sent)
            report.abandoned = sum(results[i] is None for i in sent)
    report.results = [r for r in results if r is not None]
    report.seconds = time.perf_counter() - started
    return report
