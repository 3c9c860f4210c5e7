"""GoogleGenAICacheController against the real google-genai client and a local fake server.

Nothing here touches the network: the fake listens on 127.0.0.1 (tests/genai_fake.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import pytest
from waiting import wait_until

pytest.importorskip("google.genai")

from genai_fake import FakeClock, FakeGenAIServer, no_network  # noqa: F401 - autouse
from google import genai
from google.genai import types
from google.oauth2.credentials import Credentials
from testpaths import REPO_DIR

from spoolctl.controllers.contract import (
    CachePrepareParams,
    Element,
    GenerateResult,
    PromptCacheController,
)
from spoolctl.controllers.genai.clean import clean_remote, default_client_factory
from spoolctl.controllers.genai.controller import GoogleGenAICacheController, generate_with_cache
from spoolctl.controllers.genai.records import (
    RemoteServiceError,
    format_expiry,
    genai_status,
    parse_ttl,
    pending_remote_deletes,
)
from spoolctl.store import BusyError, ConfigError, NotFoundError, Store, StoreIOError

MODEL = "gemini-2.0-flash"
BOOK = "the long shared document " * 40




@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def server(clock, monkeypatch):
    with FakeGenAIServer(clock=clock) as srv:
        # the operator's opt-in for a non-Google endpoint (decision 2010): without it
        # clean_remote sends no credentials to the fake's plain-http address
        monkeypatch.setenv("SPOOLCTL_GENAI_ENDPOINTS", srv.base_url)
        yield srv


def gemini_client(server: FakeGenAIServer, key: str = "test-key") -> genai.Client:
    return genai.Client(api_key=key, http_options=types.HttpOptions(
        base_url=server.base_url, api_version="v1beta"))


def vertex_client(server: FakeGenAIServer) -> genai.Client:
    return genai.Client(vertexai=True, project="proj-1", location="us-central1",
                        credentials=Credentials(token="test-token"),
                        http_options=types.HttpOptions(base_url=server.base_url,
                                                       api_version="v1beta1"))


@pytest.fixture
def client(server):
    return gemini_client(server)


@pytest.fixture
def ctl(client, store, clock):
    with GoogleGenAICacheController(client, store, clock=clock) as c:
        yield c


def params(doc: str = BOOK, **kw) -> CachePrepareParams:
    base = dict(
        model=MODEL,
        instructions=[Element("You answer questions about the document.", role="system")],
        data=[Element(doc, role="user"), Element("What is it about?", role="user",
                                                 cache="volatile")],
        tools=[{"name": "lookup", "description": "find a page",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}],
    )
    base.update(kw)
    return CachePrepareParams(**base)


def creates(server: FakeGenAIServer) -> int:
    return len([r for r in server.requests("POST") if r.path.endswith("/cachedContents")])


def genai_rows(store: Store, **kw):
    return store.entries(kind="genai", **kw)


# -- TTL ------------------------------------------------------------------------------------

def test_ttl_accepts_seconds_and_rejects_everything_else(client, store):
    assert parse_ttl("3600s") == 3600
    assert parse_ttl("90.5s") == 90.5
    for bad in ("1h", "3600", "-5s", "0s", "s", " 60s", 60):
        with pytest.raises(ConfigError, match="invalid cache TTL") as info:
            parse_ttl(bad)  # type: ignore[arg-type]
        assert '"3600s"' in str(info.value)
    with pytest.raises(ConfigError, match="invalid cache TTL '1h'"):
        GoogleGenAICacheController(client, store, ttl="1h")


# -- create and reuse --------------------------------------------------------------------------

def test_create_sends_the_cacheable_prefix_and_records_it(ctl, server, store, clock):
    handle = ctl.prepare(params())
    assert handle.ref and handle.ref.startswith("cachedContents/")
    assert handle.includes.instructions and handle.includes.tools
    assert handle.includes.data_element_count == 1  # the volatile question stays out
    assert handle.written_tokens == handle.cached_tokens > 0 and handle.source == "cold"
    (req,) = [r for r in server.requests("POST") if r.path == "/v1beta/cachedContents"]
    body = req.body
    assert body["model"] == f"models/{MODEL}" and body["ttl"] == "3600s"
    assert body["displayName"] == "spoolctl"
    assert body["systemInstruction"]["parts"][0]["text"].startswith("You answer")
    assert [c["parts"][0]["text"] for c in body["contents"]] == [BOOK]
    assert body["tools"][0]["functionDeclarations"][0]["name"] == "lookup"

    (row,) = genai_rows(store)
    assert row.hint == "retain" and row.namespace == ctl.namespace
    assert row.index["name"] == handle.ref and row.index["model"] == f"models/{MODEL}"
    assert row.index["expire_time"] == pytest.approx(clock() + 3600)
    assert row.index["key"] == params().key()
    meta = store.manifest(row.entry_id).meta
    assert meta["token_count"] == handle.cached_tokens and meta["display_name"] == "spoolctl"
    assert meta["target"]["api"] == "gemini"


def test_identical_prepare_reuses_from_memory_without_a_request(ctl, server):
    first = ctl.prepare(params())
    before = len(server.requests())
    again = ctl.prepare(params())
    assert again.ref == first.ref and again.reused_tokens == first.cached_tokens
    assert again.source == "memory" and again.written_tokens == 0
    assert len(server.requests()) == before  # no request at all
    other = ctl.prepare(params(doc=BOOK + " changed"))
    assert other.ref != first.ref and creates(server) == 2


def test_volatile_tail_does_not_change_the_cache(ctl, server):
    a = ctl.prepare(params())
    b = ctl.prepare(params(data=[Element(BOOK, role="user"),
                                 Element("A different question", cache="volatile")]))
    assert a.ref == b.ref and creates(server) == 1


def test_another_controller_reuses_the_store_record_after_checking_the_server(
        server, store, clock):
    with GoogleGenAICacheController(gemini_client(server), store, clock=clock) as one:
        handle = one.prepare(params())
        two = GoogleGenAICacheController(gemini_client(server), store, clock=clock)
        reused = two.prepare(params())
        assert reused.ref == handle.ref and two.stats()["disk_hits"] == 1
        assert reused.source == "disk"
        assert creates(server) == 1
        assert server.requests("GET", handle.ref.split("/")[-1])  # confirmed on the server
        two.close()  # two created nothing, so it deletes nothing
        assert handle.ref in server.live_names()
    assert handle.ref not in server.live_names()  # one.close() deleted what it created


def test_store_record_of_a_cache_gone_on_the_server_is_replaced(server, store, clock):
    one = GoogleGenAICacheController(gemini_client(server), store, clock=clock)
    old = one.prepare(params())
    server.state.caches.clear()  # deleted out of band (console, another tool)
    two = GoogleGenAICacheController(gemini_client(server), store, clock=clock)
    new = two.prepare(params())
    assert new.ref != old.ref and creates(server) == 2
    states = {r.index["name"]: r.hint for r in genai_rows(store)}
    assert states == {old.ref: "release", new.ref: "retain"}
    two.close()
    one.close()


def test_read_only_never_creates(ctl, server, store):
    assert not ctl.prepare(params(read_only=True))
    assert creates(server) == 0 and genai_rows(store) == []
    made = ctl.prepare(params())
    assert ctl.prepare(params(read_only=True)).ref == made.ref


def test_volatile_instruction_cannot_be_cached_and_runs_cold(ctl, server):
    p = params(instructions=[Element("static"), Element("today is Monday", cache="volatile")])
    assert not ctl.prepare(p)
    assert creates(server) == 0
    result = ctl.generate(p, "hello")
    req = server.requests("POST", ":generateContent")[-1].body
    assert "cachedContent" not in req and "systemInstruction" in req
    assert result.usage.cache_read_tokens == 0


# -- expiry ---------------------------------------------------------------------------------

def test_expired_cache_is_swept_and_recreated(ctl, server, store, clock):
    first = ctl.prepare(params())
    clock.advance(3601)
    assert first.ref not in server.live_names()  # the service dropped it
    second = ctl.prepare(params())
    assert second.ref != first.ref and creates(server) == 2
    rows = {r.index["name"]: r for r in genai_rows(store)}
    assert rows[first.ref].hint == "release" and not rows[first.ref].index.get("remote_pending")
    assert not server.requests("DELETE")  # nothing to delete for an expired cache
    assert store.clean_released().entries == 1
    assert [r.index["name"] for r in genai_rows(store)] == [second.ref]


def test_sweep_expired_releases_only_expired_records(ctl, store, clock):
    a = ctl.prepare(params())
    clock.advance(1800)
    b = ctl.prepare(params(doc="another document " * 30))
    clock.advance(1801)
    assert ctl.sweep_expired() == [a.ref]
    hints = {r.index["name"]: r.hint for r in genai_rows(store)}
    assert hints == {a.ref: "release", b.ref: "retain"}


def test_cache_close_to_expiry_is_extended_with_a_patch(client, store, server, clock):
    with GoogleGenAICacheController(client, store, ttl="120s", min_remaining=60,
                                    clock=clock) as c:
        first = c.prepare(params())
        clock.advance(70)
        again = c.prepare(params())
        assert again.ref == first.ref and creates(server) == 1
        (patch,) = server.requests("PATCH")
        assert patch.body == {"ttl": "120s"}
        (row,) = genai_rows(store)
        assert row.index["expire_time"] == pytest.approx(clock() + 120)
        assert c.stats()["extends"] == 1


# -- coalescing ------------------------------------------------------------------------------

def run_threads(fn, n: int) -> list[threading.Thread]:
    threads = [threading.Thread(target=fn) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_concurrent_identical_prepares_in_threads_make_one_create(ctl, server):
    gate = server.state.create_gate = threading.Event()
    results, errors = [], []

    def work():
        try:
            results.append(ctl.prepare(params()).ref)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = run_threads(work, 8)
    # All eight are inside prepare while the one create is held open on the server.
    wait_until(lambda: ctl.stats()["coalesced"] == 7 and creates(server) == 1)
    gate.set()
    for t in threads:
        t.join(30)
    assert not errors and len(results) == 8 and len(set(results)) == 1
    assert creates(server) == 1


def test_concurrent_identical_aprepares_in_asyncio_make_one_create(ctl, server):
    gate = server.state.create_gate = threading.Event()

    async def main():
        from_thread: list = []
        t = threading.Thread(target=lambda: from_thread.append(ctl.prepare(params())))
        tasks = [asyncio.create_task(ctl.aprepare(params())) for _ in range(6)]
        t.start()
        while ctl.stats()["coalesced"] < 6:  # six of the seven wait on the first one
            await asyncio.sleep(0.01)
        gate.set()
        got = await asyncio.gather(*tasks)
        await asyncio.to_thread(t.join, 30)
        return got + from_thread

    handles = asyncio.run(main())
    assert len(handles) == 7 and len({h.ref for h in handles}) == 1
    assert sorted(h.source for h in handles) == ["coalesced"] * 6 + ["cold"]
    assert creates(server) == 1


def test_coalesced_handles_count_the_created_tokens_once(ctl, server):
    """Decision 1021: every waiter gets the creator's cache as "coalesced" with nothing
    written or reused by itself, so usage summed over callers counts one create."""
    gate = server.state.create_gate = threading.Event()
    handles = []
    threads = run_threads(lambda: handles.append(ctl.prepare(params())), 4)
    wait_until(lambda: ctl.stats()["coalesced"] == 3 and creates(server) == 1)
    gate.set()
    for t in threads:
        t.join(30)
    (made,) = [h for h in handles if h.source == "cold"]
    joined = [h for h in handles if h.source == "coalesced"]
    assert len(joined) == 3 and {h.ref for h in joined} == {made.ref}
    assert all(h.written_tokens == h.reused_tokens == 0 for h in joined)
    assert sum(h.written_tokens for h in handles) == made.cached_tokens > 0


def test_failed_create_is_reported_to_every_waiter_and_not_cached(ctl, server, store):
    gate = server.state.create_gate = threading.Event()
    server.fail_next(500, method="POST", path="cachedContents$")
    errors: list[BaseException] = []

    def work():
        try:
            ctl.prepare(params())
        except Exception as exc:
            errors.append(exc)

    threads = run_threads(work, 4)
    wait_until(lambda: ctl.stats()["coalesced"] == 3)
    gate.set()
    for t in threads:
        t.join(30)
    assert len(errors) == 4 and all(isinstance(e, RemoteServiceError) for e in errors)
    assert genai_rows(store) == []
    assert ctl.prepare(params()).ref  # the next try is a fresh create


# -- release and close -------------------------------------------------------------------------

def test_release_deletes_on_the_server_at_once(ctl, server, store):
    handle = ctl.prepare(params())
    ctl.release(handle.ref)
    assert handle.ref not in server.live_names()
    (delete,) = server.requests("DELETE")
    assert delete.path == f"/v1beta/{handle.ref}"
    (row,) = genai_rows(store)
    assert row.hint == "release" and not row.index.get("remote_pending")
    again = ctl.prepare(params())  # out of reuse at once
    assert again.ref != handle.ref


def test_close_deletes_every_cache_this_controller_created(client, server, store, clock):
    c = GoogleGenAICacheController(client, store, clock=clock)
    refs = {c.prepare(params(doc=f"document number {i} " * 20)).ref for i in range(3)}
    assert refs <= server.live_names()
    c.close()
    assert not (refs & server.live_names())
    assert genai_rows(store) == []  # records of deleted caches are removed too
    c.close()  # idempotent
    with pytest.raises(ConfigError, match="closed"):
        c.prepare(params())


def test_aclose_deletes_caches_made_with_aprepare(client, server, store, clock):
    async def main():
        async with GoogleGenAICacheController(client, store, clock=clock) as c:
            h = await c.aprepare(params())
            assert h.ref in server.live_names()
            return h.ref

    ref = asyncio.run(main())
    assert ref not in server.live_names() and genai_rows(store) == []


def test_failed_delete_stays_released_and_clean_remote_retries(ctl, server, store, caplog):
    handle = ctl.prepare(params())
    server.fail_next(500, method="DELETE")
    with caplog.at_level(logging.WARNING, logger="spoolctl.genai"):
        ctl.release(handle.ref)  # a hint: reports, does not raise
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "spoolctl.genai"]
    assert "\n" not in msg and "500" in msg and handle.ref in msg
    (row,) = genai_rows(store)
    assert row.hint == "release" and row.index["remote_pending"] is True
    assert "500" in row.index["remote_error"]
    assert handle.ref in server.live_names()  # still billed: the record must survive
    assert store.clean_released().entries == 0  # held for the remote delete
    (status,) = genai_status(store, now=ctl.clock())
    assert status.state == "delete-pending" and "500" in status.remote_error
    assert [r.name for r in pending_remote_deletes(store, now=ctl.clock())] == [handle.ref]

    skipped = clean_remote(store, client_factory=lambda target: None, now=ctl.clock())
    assert skipped.skipped and "no credentials for Gemini API" in skipped.skipped[0][1]
    assert genai_rows(store)[0].index["remote_pending"] is True

    dry = clean_remote(store, client_factory=lambda t: gemini_client(server), dry_run=True,
                       now=ctl.clock())
    assert dry.deleted == [handle.ref] and handle.ref in server.live_names()

    report = clean_remote(store, client_factory=lambda t: gemini_client(server),
                          now=ctl.clock())
    assert report.deleted == [handle.ref] and report.ok
    assert handle.ref not in server.live_names()
    assert store.clean_released().entries == 1
    assert genai_rows(store) == []


def test_clean_remote_reports_a_second_failure_and_treats_404_as_done(ctl, server, store):
    a = ctl.prepare(params())
    b = ctl.prepare(params(doc="other " * 30))
    server.fail_next(403, method="DELETE", times=2)
    ctl.release(a.ref)
    ctl.release(b.ref)
    server.fail_next(429, method="DELETE", path=a.ref.split("/")[-1])
    server.state.caches.pop(b.ref)  # b vanished meanwhile
    report = clean_remote(store, client_factory=lambda t: gemini_client(server),
                          now=ctl.clock())
    assert report.already_gone == [b.ref]
    (failed_name, error), = report.failed
    assert failed_name == a.ref and "429" in error and "RESOURCE_EXHAUSTED" in error
    assert any("failed" in line for line in report.lines())
    pending = [r.index["name"] for r in genai_rows(store) if r.index.get("remote_pending")]
    assert pending == [a.ref]


def test_default_client_factory_names_the_missing_key(server, store, ctl, monkeypatch):
    handle = ctl.prepare(params())
    server.fail_next(500, method="DELETE")
    ctl.release(handle.ref)
    for var in ("GEMINI_API_KEY", "GOOGLE_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    report = clean_remote(store, now=ctl.clock())
    (name, reason), = report.skipped
    assert name == handle.ref and "GOOGLE_API_KEY" in reason
    monkeypatch.setenv("GOOGLE_API_KEY", "test-key")  # the fake's key; base_url recorded
    report = clean_remote(store, client_factory=default_client_factory, now=ctl.clock())
    assert report.deleted == [handle.ref], report.to_json()
    assert report.deleted == [handle.ref] and handle.ref not in server.live_names()


def test_clean_remote_settles_expired_records_without_requests(ctl, server, store, clock):
    handle = ctl.prepare(params())
    clock.advance(4000)
    before = len(server.requests())
    report = clean_remote(store, client_factory=lambda t: pytest.fail("no client needed"),
                          now=clock())
    assert report.expired == [handle.ref] and len(server.requests()) == before
    assert store.clean_released().entries == 1


# -- server errors ---------------------------------------------------------------------------

@pytest.mark.parametrize(("status", "error", "words"), [
    (403, ConfigError, "PERMISSION_DENIED"),
    (429, BusyError, "RESOURCE_EXHAUSTED"),
    (500, RemoteServiceError, "INTERNAL"),
    (404, NotFoundError, "NOT_FOUND"),
])
def test_server_errors_on_create_are_one_clear_line(ctl, server, store, status, error, words):
    server.fail_next(status, method="POST")
    with pytest.raises(error) as info:
        ctl.prepare(params())
    text = str(info.value)
    assert "\n" not in text and str(status) in text and words in text
    assert "creating a cached content failed on Gemini API" in text
    assert info.value.fix
    assert genai_rows(store) == []


def test_wrong_api_key_and_too_small_content(server, store, clock):
    bad = GoogleGenAICacheController(gemini_client(server, key="wrong"), store, clock=clock)
    with pytest.raises(ConfigError, match=r"403 PERMISSION_DENIED.*API key / credentials"):
        bad.prepare(params())
    bad.close()
    server.state.min_cache_tokens = 10_000
    c = GoogleGenAICacheController(gemini_client(server), store, clock=clock)
    with pytest.raises(ConfigError, match=r"400 INVALID_ARGUMENT.*too small"):
        c.prepare(params())
    c.close()
    assert genai_rows(store) == []


def test_a_cache_that_cannot_be_recorded_is_deleted_on_the_server(ctl, server, store,
                                                                 monkeypatch):
    def broken_put(**kw):
        raise StoreIOError("disk full", path=store.root, fix="free space")

    monkeypatch.setattr(store, "put", broken_put)
    with pytest.raises(StoreIOError):
        ctl.prepare(params())
    assert creates(server) == 1 and server.live_names() == set()


# -- generate ---------------------------------------------------------------------------------

def test_generate_uses_the_cache_and_reports_cache_read_tokens(ctl, server):
    p = params()
    handle = ctl.prepare(p)
    result = ctl.generate(handle, "Summarise it in one line.")
    req = server.requests("POST", ":generateContent")[-1]
    assert req.path == f"/v1beta/models/{MODEL}:generateContent"
    body = req.body
    assert body["cachedContent"] == handle.ref
    assert "systemInstruction" not in body and "tools" not in body
    texts = [c["parts"][0]["text"] for c in body["contents"]]
    assert texts == ["What is it about?", "Summarise it in one line."]  # BOOK not re-sent
    assert result.usage.cache_read_tokens == handle.cached_tokens > 0
    assert result.usage.prompt_tokens == handle.cached_tokens + 9  # 4 + 5 fresh words
    assert result.text.startswith("ok cached=")
    assert ctl.stats()["queries"] == 1
    assert ctl.stats()["cache_read_tokens"] == handle.cached_tokens
    assert result.handle == handle

    cold = generate_with_cache(ctl.client, p, type(handle)(), "Summarise it in one line.")
    cold_body = server.requests("POST", ":generateContent")[-1].body
    assert "cachedContent" not in cold_body and "systemInstruction" in cold_body
    assert len(cold_body["contents"]) == 3 and cold.usage.cache_read_tokens == 0


def test_generate_on_a_cache_gone_on_the_server_reruns_cold(ctl, server, caplog):
    p = params()
    handle = ctl.prepare(p)
    server.state.caches.clear()  # gone behind the controller's back
    with pytest.raises(NotFoundError, match="gone on the server"):
        generate_with_cache(ctl.client, p, handle, "hello")  # the low-level helper says so
    with caplog.at_level(logging.WARNING, logger="spoolctl.genai"):
        result = ctl.generate(handle, "hello")  # the controller recovers
    assert result.usage.cache_read_tokens == 0 and not result.handle
    body = server.requests("POST", ":generateContent")[-1].body
    assert "cachedContent" not in body and len(body["contents"]) == 3
    assert "rerunning cold" in caplog.text
    again = ctl.prepare(p)  # the dead cache is not reused
    assert again.ref != handle.ref and again.source == "cold"


def test_generate_from_params_prepares_and_needs_params_for_foreign_handles(ctl, server):
    p = params()
    result = ctl.generate(p, "hi", max_new_tokens=5)
    assert result.handle.ref and result.usage.cache_read_tokens == result.handle.cached_tokens
    body = server.requests("POST", ":generateContent")[-1].body
    assert body["generationConfig"]["maxOutputTokens"] == 5
    with pytest.raises(ConfigError, match="not prepared by this controller"):
        ctl.generate(type(result.handle)(), "hi")


def test_explicit_params_win_over_the_handle_and_a_foreign_handle_runs_cold(ctl, server,
                                                                            caplog):
    """Decision 1022: ``generate(handle, params=P)`` answers P, with the handle's cache only
    if the handle is P's cache; a cache of other params is never sent with P's prompt."""
    a, b = params(), params(doc="another document entirely " * 40)
    ha = ctl.prepare(a)
    with caplog.at_level(logging.WARNING, logger="spoolctl.genai"):
        res = ctl.generate(ha, "hi", params=b)
    body = server.requests("POST", ":generateContent")[-1].body
    assert "cachedContent" not in body and res.usage.cache_read_tokens == 0 and not res.handle
    assert type(res) is GenerateResult  # one result class for every controller
    assert "another document entirely" in body["contents"][0]["parts"][0]["text"]
    assert "prepared for other params" in caplog.text
    # Only the volatile question differs: the same cache, used.
    same = params(data=[Element(BOOK, role="user"), Element("Who wrote it?", role="user",
                                                            cache="volatile")])
    res = ctl.generate(ha, "hi", params=same)
    body = server.requests("POST", ":generateContent")[-1].body
    assert body["cachedContent"] == ha.ref and res.usage.cache_read_tokens == ha.cached_tokens
    assert [c["parts"][0]["text"] for c in body["contents"]] == ["Who wrote it?", "hi"]
    # A handle this controller did not prepare is checked against its store record.
    with GoogleGenAICacheController(ctl.client, ctl.store) as other:
        res = other.generate(ha, "hi", params=b)
        assert res.usage.cache_read_tokens == 0 and not res.handle
        res = other.generate(ha, "hi", params=a)
        assert res.usage.cache_read_tokens == ha.cached_tokens and res.handle == ha
    with pytest.raises(ConfigError, match="params twice"):
        ctl.generate(a, "hi", params=b)


def test_agenerate(ctl, server):
    p = params()

    async def main():
        h = await ctl.aprepare(p)
        return h, await ctl.agenerate(h, "hello there")

    handle, result = asyncio.run(main())
    assert result.usage.cache_read_tokens == handle.cached_tokens


# -- Vertex AI ---------------------------------------------------------------------------------

def test_vertex_keeps_full_resource_names(server, store, clock):
    with GoogleGenAICacheController(vertex_client(server), store, clock=clock) as c:
        p = params()
        handle = c.prepare(p)
        assert handle.ref.startswith("projects/proj-1/locations/us-central1/cachedContents/")
        (create,) = server.requests("POST", "/cachedContents")
        assert create.path == "/v1beta1/projects/proj-1/locations/us-central1/cachedContents"
        assert create.body["model"] == ("projects/proj-1/locations/us-central1/publishers/"
                                        f"google/models/{MODEL}")
        assert c.namespace.startswith("vertex-")
        (row,) = genai_rows(store)
        assert row.index["name"] == handle.ref
        assert store.manifest(row.entry_id).meta["target"]["project"] == "proj-1"
        result = c.generate(handle, "hi")
        assert result.usage.cache_read_tokens == handle.cached_tokens
        gen = server.requests("POST", ":generateContent")[-1]
        assert gen.path.endswith(f"/publishers/google/models/{MODEL}:generateContent")
        c.release(handle.ref)
        assert server.requests("DELETE")[-1].path == f"/v1beta1/{handle.ref}"


def test_controller_meets_the_contract(ctl):
    assert isinstance(ctl, PromptCacheController)


def test_gemini_and_vertex_records_do_not_mix(server, store, clock):
    with GoogleGenAICacheController(gemini_client(server), store, clock=clock) as g, \
            GoogleGenAICacheController(vertex_client(server), store, clock=clock) as v:
        assert g.namespace != v.namespace
        assert g.prepare(params()).ref != v.prepare(params()).ref
        assert creates(server) == 2


# -- status and the store guard --------------------------------------------------------------

def test_status_shows_time_to_expiry(ctl, store, clock):
    handle = ctl.prepare(params())
    clock.advance(600)
    (row,) = genai_status(store, now=clock())
    assert row.name == handle.ref and row.state == "live"
    assert row.expires_in == pytest.approx(3000)
    assert format_expiry(row.expires_in) == "in 50m 00s"
    assert format_expiry(-125) == "expired 2m 05s ago"
    assert row.to_json()["token_count"] == handle.cached_tokens


def test_held_entries_survive_clean_and_eviction(store_root):
    with Store.open(store_root, create=True, max_bytes=4096) as s:
        held = s.put(kind="genai", namespace="ns", key="held", objects={}, index={"name": "x"})
        assert s.update_index(held.entry_id, {"remote_pending": True})
        s.release(held.entry_id)
        assert s.clean_released().entries == 0
        for i in range(40):  # push the store over capacity
            s.put(kind="pytorch", namespace="ns", key=f"k{i}", objects={"kv": bytes(200)})
        s.enforce_capacity()
        assert s.row(held.entry_id) is not None
        assert s.update_index(held.entry_id, {"remote_pending": None})
        assert "remote_pending" not in s.row(held.entry_id).index
        assert s.clean_released().entries >= 1 and s.row(held.entry_id) is None
        with pytest.raises(ConfigError):
            s.update_index(held.entry_id, {"bad": float("nan")})


# -- packaging ------------------------------------------------------------------------------

def test_status_and_clean_helpers_do_not_import_the_sdk():
    import subprocess
    import sys

    code = ("import sys, spoolctl.controllers.genai.clean, spoolctl.controllers.genai.records;"
            "print(any(m.startswith('google') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_example_runs_against_the_fake(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    example = REPO_DIR / "examples" / "genai_controller.py"
    out = subprocess.run([sys.executable, str(example), "--fake",
                          "--root", str(Path(os.path.realpath(tmp_path)) / "store")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "cache_read_tokens\": 2206" in out.stdout and "deleted on the server" in out.stdout


@pytest.mark.parametrize("shape", ["gemini", "vertex"])
def test_fake_serves_the_rest_surface_the_sdk_uses(server, shape):
    from google.genai import errors

    c = gemini_client(server) if shape == "gemini" else vertex_client(server)
    names = [c.caches.create(model=MODEL, config={"contents": f"doc {i}", "ttl": "60s"}).name
             for i in range(3)]
    assert sorted(cc.name for cc in c.caches.list(config={"page_size": 2})) == sorted(names)
    assert server.requests("GET", "/cachedContents")[-1].query["pageToken"] == ["2"]
    got = c.caches.get(name=names[0])
    assert got.usage_metadata.total_token_count == 2
    patched = c.caches.update(name=names[0], config={"ttl": "600s"})
    assert (patched.expire_time - got.expire_time).total_seconds() == pytest.approx(540)
    with pytest.raises(errors.ClientError) as info:
        c.caches.create(model=MODEL, config={"contents": "x", "ttl": "1h"})
    assert info.value.code == 400 and "ttl" in info.value.message
    c.caches.delete(name=names[0])
    with pytest.raises(errors.ClientError) as info:
        c.caches.get(name=names[0])
    assert info.value.code == 404


def test_tenants_on_an_encrypted_store(server, store_root, clock, monkeypatch, caplog):
    """``tenant=`` on an encrypted store (issue 33 item 6, decision 2821): a tenant's record
    holds no clear-text prompt data (its key is keyed per tenant) and is found by the same
    tenant only; another tenant or none creates its own cache; after ``keys revoke`` it is a
    miss; a lost master key is one line, then misses with nothing recorded; a tenant on a
    store without encryption is refused in one line."""
    pytest.importorskip("cryptography")
    import secrets

    from operator_cli import run_json

    from spoolctl.store.sealing import COMMAND_ENV, FILE_ENV, VALUE_ENV, MasterKey

    for name in (FILE_ENV, VALUE_ENV, COMMAND_ENV):
        monkeypatch.delenv(name, raising=False)
    master = secrets.token_hex(32)
    p = params()
    with Store.open(store_root, create=True, master_key=MasterKey.from_hex(master, "t")) as st, \
            GoogleGenAICacheController(gemini_client(server), st, clock=clock,
                                       tenant="acme") as acme:
        first = acme.prepare(p)
        assert first.source == "cold" and creates(server) == 1
        assert acme.generate(first, "What is it about?").usage.cache_read_tokens > 0
        for path in (f for f in store_root.rglob("*") if f.is_file()):
            data = path.read_bytes()
            assert p.key().encode() not in data and b"acme" not in data, path
            assert BOOK[:40].encode() not in data, path
        with GoogleGenAICacheController(gemini_client(server), st, clock=clock,
                                        tenant="acme") as again:
            hit = again.prepare(p)
            assert hit.source == "disk" and hit.ref == first.ref and creates(server) == 1
        for n, other in enumerate(("globex", None), start=2):
            with GoogleGenAICacheController(gemini_client(server), st, clock=clock,
                                            tenant=other) as ctl:
                got = ctl.prepare(p)
                assert got.source == "cold" and got.ref != first.ref, other
                assert creates(server) == n
        run_json("keys", "revoke", "--tenant-env", "SPOOLCTL_TENANT", "--yes",
                 "--root", str(store_root), env={
                     VALUE_ENV: master, "SPOOLCTL_TENANT": "acme",
                     # erased keys are recorded outside the store
                     "SPOOLCTL_KEY_LEDGER": str(store_root.parent / "erased-keys.json")})
        with GoogleGenAICacheController(gemini_client(server), st, clock=clock,
                                        tenant="acme") as revoked:
            assert revoked.prepare(p).source == "cold" and creates(server) == 4

    # The master key lost and replaced: one line at open, then misses; nothing recorded, and
    # the caches made meanwhile are deleted at close (none left billed unrecorded).
    before = sorted(f.name for f in (store_root / "manifests").rglob("*.json"))
    caplog.clear()
    with Store.open(store_root, master_key=MasterKey.from_hex(secrets.token_hex(32), "new")) \
            as st, caplog.at_level(logging.WARNING, logger="spoolctl"):
        with GoogleGenAICacheController(gemini_client(server), st, clock=clock,
                                        tenant="acme") as lost:
            made = lost.prepare(p)
            assert made.source == "cold" and creates(server) == 5
        assert made.ref not in server.live_names()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "not the one this store's keyring" in lines[0], lines
    assert sorted(f.name for f in (store_root / "manifests").rglob("*.json")) == before

    with Store.open(store_root.parent / "plain", create=True, master_key=None) as plain, \
            pytest.raises(ConfigError, match="no encryption at rest configured") as err:
        GoogleGenAICacheController(gemini_client(server), plain, tenant="acme")
    assert "\n" not in str(err.value)
