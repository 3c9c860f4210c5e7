"""`spoolctl status` and `spoolctl clean [--genai]` on genai records, as real processes, with
the real google-genai client talking to the local fake REST server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("google.genai")

from genai_fake import FakeGenAIServer
from google import genai
from google.genai import types

from spoolctl.controllers.contract import CachePrepareParams, Element
from spoolctl.controllers.genai.controller import GoogleGenAICacheController
from spoolctl.store import Store

SPOOLCTL = str(Path(sys.executable).with_name("spoolctl"))


def run(*args: str, key: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("GEMINI_API_KEY", "GOOGLE_API_KEY")}
    if key:
        env["GEMINI_API_KEY"] = key
    return subprocess.run([SPOOLCTL, *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_clean_skips_then_deletes_a_cache_whose_server_delete_failed(store_root: Path) -> None:
    with FakeGenAIServer() as server, Store.open(store_root, create=True) as store:
        client = genai.Client(api_key="test-key", http_options=types.HttpOptions(
            base_url=server.base_url, api_version="v1beta"))
        ctl = GoogleGenAICacheController(client, store)
        handle = ctl.prepare(CachePrepareParams(
            model="gemini-2.5-flash",
            instructions=[Element("You answer questions about the manual.", role="system")],
            data=[Element("The manual. " * 400, role="user")]))
        server.fail_next(500, method="DELETE")
        ctl.release(handle.ref)
        assert handle.ref in server.live_names()  # still billed

        status = run("status", "--root", str(store_root), "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["genai"]["entries"] == 1

        plain = run("clean", "--root", str(store_root), "--yes", "--json")
        doc = json.loads(plain.stdout)
        assert plain.returncode == 0 and doc["genai"]["skipped_pending"] == 1
        assert handle.ref in server.live_names()
        assert store.entries(kind="genai"), "the record that lets a retry find it must survive"

        text = run("clean", "--root", str(store_root), "--yes")
        assert "rerun with --genai" in text.stdout

        remote = run("clean", "--genai", "--genai-endpoint", server.base_url,
                     "--root", str(store_root), "--yes", "--json", key="test-key")
        doc = json.loads(remote.stdout)
        assert remote.returncode == 0, remote.stderr
        assert doc["genai"]["deleted"] == [handle.ref]
        assert handle.ref not in server.live_names()
        assert store.entries(kind="genai") == []
        ctl.close()
