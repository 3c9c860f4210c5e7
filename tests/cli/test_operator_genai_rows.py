"""Issue 15 item 7, the GenAI side: one malformed GenAI record never stops a job.

The store checks only the index facts it interprets (``expire_time``, ``remote_pending``,
``test_operator_rows.py``). The GenAI helpers read more: the cache's name, token count,
model, display name and the manifest's meta. A record with one bad value there (edited by
hand, written by another tool) made ``spoolctl clean --genai`` fail for every record, so no
billed server cache was deleted again, and a ``null`` expiry made every ``prepare`` of the
controller's namespace fail. Now each record is read field by field: a bad one is skipped
and reported (clean's JSON and lines, ``status`` and ``--check``, a ``doctor`` finding),
re-indexed from its manifest where the manifest is good, and never sent to the server
under a name that is not a cached-content name. Real processes, the real google-genai
client, the local fake of the REST API."""

from __future__ import annotations

import json
import os
import sqlite3
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


def run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLCTL_")}
    env["GEMINI_API_KEY"] = "test-key"
    return subprocess.run([SPOOLCTL, *args], capture_output=True, text=True, env=env,
                          timeout=120)


def _edit(root: Path, entry_id: str, path: str, value: object) -> None:
    """What an operator with ``sqlite3`` (or another tool) does to one index field."""
    db = sqlite3.connect(root / "state" / "catalog.sqlite3")
    with db:
        db.execute("UPDATE entries SET index_json=json_set(index_json, ?, json(?)) "
                   "WHERE entry_id=?", (path, json.dumps(value), entry_id))
    db.close()


def _params(n: int) -> CachePrepareParams:
    return CachePrepareParams(model="gemini-2.5-flash",
                              instructions=[Element(f"System prompt {n}.", role="system")],
                              data=[Element(f"Document {n}. " * 200, role="user")])


def test_malformed_genai_records_are_skipped_reported_and_repaired(store_root: Path) -> None:
    with FakeGenAIServer() as server:
        client = genai.Client(api_key="test-key", http_options=types.HttpOptions(
            base_url=server.base_url, api_version="v1beta"))
        with Store.open(store_root, create=True) as store:
            ctl = GoogleGenAICacheController(client, store)
            handles = [ctl.prepare(_params(n)) for n in range(3)]
            server.fail_next(500, method="DELETE", times=6)  # release and close
            for h in handles:
                ctl.release(h.ref)  # server delete failed: owed, recorded as pending
            pending = {r.index["name"]: r.entry_id for r in store.entries(kind="genai")}
            target = dict(store.manifest(pending[handles[0].ref]).meta["target"])
            # written by another tool: a pending delete whose manifest is not what we write
            other = store.put(kind="genai", namespace=ctl.namespace, key="x/cachedContents/o",
                              objects={}, meta={"name": "cachedContents/o", "target": target,
                                                "token_count": "lots"},
                              index={"name": "cachedContents/o", "expire_time": 4e9,
                                     "remote_pending": True}).entry_id
            evil = store.put(kind="genai", namespace=ctl.namespace, key="x/cachedContents/e",
                             objects={}, meta={"name": "cachedContents/e", "target": target},
                             index={"name": "../../v1beta/models/evil", "expire_time": 4e9,
                                    "remote_pending": True}).entry_id
            ctl.close()
        a, b, _c = (pending[h.ref] for h in handles)  # the third stays well-formed
        _edit(store_root, a, "$.token_count", "many")
        _edit(store_root, b, "$.display_name", [1, 2])

        status = run("status", "--root", str(store_root), "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["genai"]["malformed"] == 3  # a, b, evil
        assert run("status", "--check", "--root", str(store_root)).returncode == 1
        doctor = json.loads(run("doctor", "--root", str(store_root), "--json").stdout)
        check = {c["name"]: c for c in doctor["checks"]}["genai.records"]
        assert check["status"] == "fail" and "token_count" in check["detail"]
        plain = run("clean", "--yes", "--root", str(store_root), "--json")
        assert plain.returncode == 1 and json.loads(plain.stdout)["genai"]["malformed"] == 3

        proc = run("clean", "--genai", "--genai-endpoint", server.base_url, "--yes",
                   "--root", str(store_root), "--json")
        doc = json.loads(proc.stdout)["genai"]
        assert proc.returncode == 1, proc.stderr  # findings: two records could not be read
        assert sorted(doc["deleted"]) == sorted(h.ref for h in handles)  # a, b re-indexed
        assert sorted(doc["repaired"]) == sorted([a, b])
        assert {r["entry_id"]: r["reason"] for r in doc["malformed_records"]} == {
            other: "meta token_count is not a count",
            evil: "index name is not a cachedContents name"}
        assert not server.live_names() & {h.ref for h in handles}
        assert server.requests("DELETE", contains="evil") == []  # never sent anywhere
        with Store.open(store_root) as store:
            left = {r.entry_id for r in store.entries(kind="genai")}
        assert left == {other, evil}  # kept: their server deletes may still be owed
        human = run("clean", "--genai", "--genai-endpoint", server.base_url, "--yes",
                    "--root", str(store_root))
        assert human.returncode == 1 and "skipped malformed record" in human.stdout


def test_a_null_expiry_never_fails_prepare(store_root: Path) -> None:
    with FakeGenAIServer() as server:
        client = genai.Client(api_key="test-key", http_options=types.HttpOptions(
            base_url=server.base_url, api_version="v1beta"))
        with Store.open(store_root, create=True) as store:
            ctl = GoogleGenAICacheController(client, store)  # not closed: close() deletes
            first = ctl.prepare(_params(1))
            ctl.prepare(_params(2))
            rows = {r.index["name"]: r.entry_id for r in store.entries(kind="genai")}
        _edit(store_root, rows[first.ref], "$.expire_time", None)  # json null
        _edit(store_root, rows[first.ref], "$.token_count", -5)
        with Store.open(store_root) as store, GoogleGenAICacheController(client, store) as ctl:
            again = ctl.prepare(_params(1))  # the bad record is a miss, not a crash
            assert again and again.source == "cold" and again.ref != first.ref
            assert ctl.prepare(_params(2)).source == "disk"
