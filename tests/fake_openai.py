"""A fake of the OpenAI completions surface a vLLM server exposes (``GET /v1/models``,
``POST /v1/completions``) on 127.0.0.1, for the tests of ``spoolctl prefill --server``
that do not need a real engine (tests/connector/test_prefill_server.py also runs a real one).

``complete(body, attempt)`` returns (HTTP status, JSON document or raw bytes) for each
completion request; ``attempt`` counts the requests for the same prompt. Every request's
body and headers are kept, and the most requests in flight at once is tracked.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Reply = tuple[int, Any]


class FakeOpenAI:
    """The fake server, serving from construction until ``close``; ``url`` is its base."""

    def __init__(self, complete: Callable[[dict, int], Reply], models=("tiny",),
                 delay: float = 0.0):
        self.complete = complete
        self.models = models
        self.delay = delay
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.attempts: dict[str, int] = {}
        self.inflight = self.max_inflight = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            disable_nagle_algorithm = True
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, status: int, doc: Any) -> None:
                data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"data": [{"id": m} for m in fake.models]})
                else:
                    self._send(404, {"error": {"message": "no such path"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.inflight += 1
                    fake.max_inflight = max(fake.max_inflight, fake.inflight)
                    fake.bodies.append(body)
                    fake.headers.append(dict(self.headers))
                    key = json.dumps(body["prompt"])
                    fake.attempts[key] = fake.attempts.get(key, 0) + 1
                    attempt = fake.attempts[key]
                try:
                    if fake.delay:
                        time.sleep(fake.delay)
                    status, doc = fake.complete(body, attempt)
                    self._send(status, doc)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (its timeout): nothing to answer
                finally:
                    with fake.lock:
                        fake.inflight -= 1

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def prompt_tokens(body: dict) -> int:
    """The prompt's length the way the fakes count it: token ids, or words of a string."""
    p = body["prompt"]
    return len(p) if isinstance(p, list) else len(p.split())
