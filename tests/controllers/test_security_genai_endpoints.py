"""A stored GenAI record never chooses where the operator's credentials go (issue 35 item 2).

Whoever can write the store writes a record's target (``base_url``, Vertex project and
location). ``clean --genai`` runs under cron with the operator's API key: it must send that
key only to Google's endpoints over https, or to an origin the OPERATOR allowed
(``SPOOLCTL_GENAI_ENDPOINTS`` / ``--genai-endpoint``) -- here the local fake on
127.0.0.1, over plain http, stands in for the attacker's server. Real google-genai client,
real CLI processes, no network (the fake listens on loopback).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("google.genai")

from genai_fake import FakeGenAIServer, no_network  # noqa: F401 - autouse
from google import genai
from google.genai import types

from spoolctl.controllers.contract import CachePrepareParams, Element
from spoolctl.controllers.genai.clean import clean_remote
from spoolctl.controllers.genai.controller import GoogleGenAICacheController
from spoolctl.controllers.genai.endpoints import ENDPOINTS_ENV, EndpointPolicy
from spoolctl.controllers.genai.records import GenaiTarget
from spoolctl.store import ConfigError, Store

SPOOLCTL = str(Path(sys.executable).with_name("spoolctl"))
KEY = "operator-secret-key"




def _pending_record(store: Store, server: FakeGenAIServer) -> str:
    """A record (written as a store writer would: the library, any base_url) whose server
    delete is still owed; returns the cache name."""
    client = genai.Client(api_key=KEY, http_options=types.HttpOptions(
        base_url=server.base_url, api_version="v1beta"))
    ctl = GoogleGenAICacheController(client, store)
    handle = ctl.prepare(CachePrepareParams(
        model="gemini-2.5-flash", instructions=[Element("Answer.", role="system")],
        data=[Element("The manual. " * 300, role="user")]))
    server.fail_next(500, method="DELETE", times=2)  # release and close both fail: owed
    ctl.release(handle.ref)
    ctl.close()
    return handle.ref


def _run(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SPOOLCTL_") and k not in ("GEMINI_API_KEY", "GOOGLE_API_KEY")}
    env["GEMINI_API_KEY"] = KEY
    env.update(env_extra or {})
    return subprocess.run([SPOOLCTL, *args], capture_output=True, text=True, env=env,
                          timeout=120)


def _keyed_requests(server: FakeGenAIServer) -> int:
    return sum(r.headers.get("x-goog-api-key") == KEY for r in server.requests())


def test_clean_remote_sends_no_key_to_a_stored_http_base_url(store, monkeypatch):
    monkeypatch.delenv(ENDPOINTS_ENV, raising=False)
    monkeypatch.setenv("GOOGLE_API_KEY", KEY)
    with FakeGenAIServer(api_key=KEY) as server:
        name = _pending_record(store, server)
        before = _keyed_requests(server)
        report = clean_remote(store)  # the default factory: the operator's key from the env
        assert _keyed_requests(server) == before, "the operator's key reached the store's URL"
        assert report.deleted == [] and not report.ok
        (refused_name, line), = report.refused
        (row,) = store.entries(kind="genai")
        assert refused_name == name and "\n" not in line
        assert f"record {row.entry_id[:16]}" in line and "not a Google endpoint over https" in line
        assert f"{ENDPOINTS_ENV}={server.base_url}" in line  # the fix, with the origin
        assert row.index["remote_pending"] is True  # still owed: nothing settled
        assert any(line in out for out in report.lines())

        monkeypatch.setenv(ENDPOINTS_ENV, server.base_url)  # the operator allows it
        report = clean_remote(store)
        assert report.deleted == [name] and name not in server.live_names()


def test_cli_clean_genai_refuses_then_follows_the_operator(store_root: Path):
    with FakeGenAIServer(api_key=KEY) as server:
        with Store.open(store_root, create=True) as store:
            name = _pending_record(store, server)
        before = _keyed_requests(server)
        proc = _run("clean", "--genai", "--yes", "--json", "--root", str(store_root))
        assert _keyed_requests(server) == before, "cron sent the key to the stored address"
        assert proc.returncode == 1, proc.stderr  # a finding
        (refused,) = json.loads(proc.stdout)["genai"]["refused"]
        assert refused["name"] == name and "--genai-endpoint" in refused["reason"]
        human = _run("clean", "--genai", "--yes", "--root", str(store_root))
        assert human.returncode == 1 and f"genai: refused {name}" in human.stdout

        bad = _run("clean", "--genai", "--yes", "--root", str(store_root),
                   env_extra={ENDPOINTS_ENV: "http://127.0.0.1:1/some/path"})
        assert bad.returncode == 2 and ENDPOINTS_ENV in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1
        lone = _run("clean", "--genai-endpoint", server.base_url, "--yes",
                    "--root", str(store_root))
        assert lone.returncode == 2 and "--genai" in lone.stderr
        assert _keyed_requests(server) == before

        ok = _run("clean", "--genai", "--yes", "--json", "--root", str(store_root),
                  env_extra={ENDPOINTS_ENV: server.base_url})
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["genai"]["deleted"] == [name]
        assert name not in server.live_names()


def test_a_stored_vertex_location_cannot_name_another_host(store, monkeypatch):
    """The SDK builds ``https://{location}-aiplatform.googleapis.com``: a location is a host
    name part, so a crafted one (``evil.example/x?``) would carry the Cloud token away."""
    monkeypatch.delenv(ENDPOINTS_ENV, raising=False)
    target = {"api": "vertex", "project": "proj-1", "location": "evil.example/x?",
              "base_url": None, "api_version": None}
    name = "projects/proj-1/locations/us-central1/cachedContents/c1"
    store.put(kind="genai", namespace="vertex-0123456789abcdef01234567", key=f"k/{name}",
              objects={}, meta={"name": name, "target": target},
              index={"name": name, "expire_time": 4e9, "remote_pending": True})

    def factory(t: GenaiTarget):
        pytest.fail(f"a client was built for {t.describe()}")

    report = clean_remote(store, client_factory=factory)
    (refused_name, line), = report.refused
    assert refused_name == name and "not a region name" in line


@pytest.mark.parametrize(("url", "allowed"), [
    (None, True),
    ("https://generativelanguage.googleapis.com/", True),
    ("https://us-central1-aiplatform.googleapis.com", True),
    ("https://GENERATIVELANGUAGE.googleapis.com:443/", True),
    ("http://generativelanguage.googleapis.com/", False),  # plain http
    ("https://generativelanguage.googleapis.com:8443/", False),
    ("https://googleapis.com.evil.example/", False),
    ("https://evilgoogleapis.com/", False),
    ("https://user@generativelanguage.googleapis.com/", False),
    ("https://evil.example\\@generativelanguage.googleapis.com/", False),
    ("//generativelanguage.googleapis.com/", False),
    ("ftp://generativelanguage.googleapis.com/", False),
    ("http://127.0.0.1:8080", False),  # not allowed by the operator here
    ("not a url", False),
])
def test_only_googles_https_endpoints_without_operator_consent(url, allowed):
    target = GenaiTarget("gemini", base_url=url)
    assert (EndpointPolicy().refusal(target) is None) is allowed, url


def test_operator_origins_come_from_the_environment_and_options_only():
    policy = EndpointPolicy.from_operator(["http://localhost:9000/"],
                                          environ={ENDPOINTS_ENV: " http://127.0.0.1:8080 ,"})
    assert policy.allowed == {"http://127.0.0.1:8080", "http://localhost:9000"}
    assert policy.refusal(GenaiTarget("gemini", base_url="http://127.0.0.1:8080/v1")) is None
    assert policy.refusal(GenaiTarget("gemini", base_url="http://127.0.0.1:8081")) is not None
    assert policy.refusal(GenaiTarget("gemini", base_url="https://127.0.0.1:8080")) is not None
    for bad in ("127.0.0.1:8080", "http://h/path", "http://u@h", "http://h?x=1"):
        with pytest.raises(ConfigError, match=ENDPOINTS_ENV):
            EndpointPolicy.from_operator(environ={ENDPOINTS_ENV: bad})
    for field, value in (("project", "p/../../x"), ("location", "us-central1.evil")):
        kw = {"project": "p", "location": "us-central1", field: value}
        assert EndpointPolicy().refusal(GenaiTarget("vertex", **kw)) is not None
    assert EndpointPolicy().refusal(GenaiTarget("gemini", api_version="v1/../x")) is not None


def _other_apps_cache(server: FakeGenAIServer) -> str:
    """A cache another application made with the same API key: nothing in the store names it."""
    client = genai.Client(api_key=KEY, http_options=types.HttpOptions(
        base_url=server.base_url, api_version="v1beta"))
    cc = client.caches.create(model="gemini-2.5-flash", config=types.CreateCachedContentConfig(
        contents=[types.Content(role="user", parts=[types.Part(text="Their data. " * 300)])],
        ttl="3600s"))
    assert cc.name is not None
    return cc.name


def test_clean_deletes_the_cache_the_manifest_names_never_the_catalogs(store, monkeypatch):
    """A store writer edits a pending record's catalog row to name another application's
    cache; root's `clean --genai` (the operator allowed this endpoint) must not delete it."""
    with FakeGenAIServer(api_key=KEY) as server:
        monkeypatch.setenv(ENDPOINTS_ENV, server.base_url)
        monkeypatch.setenv("GOOGLE_API_KEY", KEY)
        ours = _pending_record(store, server)
        theirs = _other_apps_cache(server)
        (row,) = store.entries(kind="genai")
        store.update_index(row.entry_id, {"name": theirs})  # any writer of the store can
        report = clean_remote(store)
        assert theirs in server.live_names(), "clean deleted a cache the store does not own"
        assert server.requests("DELETE", contains=theirs.split("/")[-1]) == []
        (refused_name, line), = report.refused
        assert refused_name == ours and "\n" not in line and not report.ok
        assert f"record {row.entry_id[:16]}" in line and "catalog row names another" in line
        store.update_index(row.entry_id, {"name": ours})  # the row put back: it is deleted
        report = clean_remote(store)
        assert report.deleted == [ours] and ours not in server.live_names()
        assert theirs in server.live_names()


@pytest.mark.parametrize(("name", "why"), [
    ("projects/proj-1/locations/us-central1/cachedContents/theirs", "names a Vertex AI cache"),
    ("cachedContents/..", "is not a cachedContents name"),
])
def test_a_manifest_cannot_name_a_cache_outside_its_target(store, monkeypatch, name, why):
    """A record written whole by the store's writer (without a tag key the manifest is theirs
    too) still deletes only a cache of its own API, project and location."""
    with FakeGenAIServer(api_key=KEY) as server:
        monkeypatch.setenv(ENDPOINTS_ENV, server.base_url)
        monkeypatch.setenv("GOOGLE_API_KEY", KEY)
        target = {"api": "gemini", "project": None, "location": None,
                  "base_url": server.base_url, "api_version": "v1beta"}
        store.put(kind="genai", namespace="gemini-0123456789abcdef01234567", key=f"k/{name}",
                  objects={}, meta={"name": name, "target": target},
                  index={"name": name, "expire_time": 4e9, "remote_pending": True})
        report = clean_remote(store)
        assert server.requests("DELETE") == []
        (refused_name, line), = report.refused
        assert refused_name == name and why in line


@pytest.mark.parametrize(("name", "refused"), [
    ("projects/proj-1/locations/us-central1/cachedContents/c1", None),
    ("projects/123456/locations/us-central1/cachedContents/c1", None),  # a project number
    ("cachedContents/c1", None),
    ("projects/proj-2/locations/us-central1/cachedContents/c1", "another project"),
    ("projects/proj-1/locations/europe-west4/cachedContents/c1", "another location"),
])
def test_a_vertex_name_must_be_in_the_records_project_and_location(name, refused):
    from spoolctl.controllers.genai.endpoints import name_refusal, scoped_name

    target = GenaiTarget("vertex", project="proj-1", location="us-central1")
    why = name_refusal(target, name)
    assert (why is None) if refused is None else (why is not None and refused in why)
    assert scoped_name(target, name) == "cachedContents/c1"  # the client adds its own scope
