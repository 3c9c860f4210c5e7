"""The controller contract, run against every local backend (real frameworks, tiny model).

Add a backend by appending its name to ``BACKENDS`` and a branch to ``make_backend``.
The second half tests the pure helpers of ``spoolctl.controllers.local.tokens``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spoolctl.controllers import (
    CacheHandle,
    CachePrepareParams,
    GenerateResult,
    LocalCacheController,
    render_segments,
)
from spoolctl.controllers.local.tokens import (
    PrefixDigests,
    TokenPrefix,
    common_prefix_tokens,
    namespace_for,
    rank_bases,
)
from spoolctl.store import ConfigError, Store

BACKENDS = ["pytorch", "mlx"]

DOC = ("Clause 4.2: the supplier keeps every invoice for seven years and answers audits "
       "within thirty days. ") * 6
SYSTEM = "You are a careful contracts assistant. Answer from the reference documents only."


def make_backend(name: str, model_dir: Path):
    if name == "pytorch":
        pytest.importorskip("transformers")
        from spoolctl.controllers.pytorch import PyTorchBackend

        return PyTorchBackend(model_dir, model_id="tiny")
    if name == "mlx":
        pytest.importorskip("mlx.core", reason="mlx is not installed here; "
                            "pip install 'mlx-lm[cpu]'")
        from spoolctl.controllers.mlx import MlxBackend

        return MlxBackend(model_dir, model_id="tiny")
    raise AssertionError(f"no factory for backend {name}")


@pytest.fixture(params=BACKENDS)
def backend(request, tiny_model_dir):
    return make_backend(request.param, tiny_model_dir)


def params(model: str = "tiny", **kw) -> CachePrepareParams:
    kw.setdefault("instructions", [{"role": "system", "content": SYSTEM}])
    kw.setdefault("data", [DOC])
    return CachePrepareParams(model=model, **kw)


def cold_tokens(backend, p: CachePrepareParams, prompt: str, n: int) -> list[int]:
    segments = [*render_segments(p), prompt]
    ids = [t for seg in backend.tokenize_segments(segments) for t in seg]
    return backend.generate(None, 0, ids, n)


def test_same_params_same_entry_from_memory_then_disk(backend, store_root):
    p = params()
    with LocalCacheController(backend, store_root) as ctl:
        first = ctl.prepare(p)
        again = ctl.prepare(params())
        assert first.source == "cold" and first.written_tokens == first.cached_tokens > 0
        assert again.ref == first.ref and again.source == "memory" and again.written_tokens == 0
    with LocalCacheController(backend, store_root) as ctl:
        disk = ctl.prepare(params())
        assert disk.ref == first.ref and disk.source == "disk"
        assert disk.cached_tokens == first.cached_tokens and disk.written_tokens == 0


def test_warm_generation_equals_cold_and_reports_usage(backend, store_root):
    p = params()
    want = cold_tokens(backend, p, "Question: how long are invoices kept?", 10)
    with LocalCacheController(backend, store_root) as ctl:
        r1 = ctl.generate(p, "Question: how long are invoices kept?", 10)
        r2 = ctl.generate(r1.handle, "Question: how long are invoices kept?", 10)
        assert r1.tokens == want and r2.tokens == want
        cached = r1.handle.cached_tokens
        # Cache tokens are reported separately, not subtracted from prompt_tokens. The
        # first call prefilled and wrote the prefix (nothing read); the second read it.
        assert r1.usage.prompt_tokens > cached > 0
        assert r1.usage.cache_read_tokens == 0 and r1.usage.cache_write_tokens == cached
        assert r1.usage.computed_tokens == r1.usage.prompt_tokens
        assert r2.usage.cache_read_tokens == r2.usage.cache_memory_tokens == cached
        assert r2.usage.cache_write_tokens == 0
        assert r2.usage.completion_tokens == len(want)
        assert ctl.stats()["queries"] == 2
        ctl.record_query()
        assert ctl.stats()["queries"] == 3


def test_prompt_fully_cached_keeps_one_token_to_run(backend, store_root):
    p = params()
    ids = [t for seg in backend.tokenize_segments(render_segments(p)) for t in seg]
    want = backend.generate(None, 0, ids, 6)
    with LocalCacheController(backend, store_root) as ctl:
        first = ctl.generate(p, "", 6)  # cold: the prefix was computed by this call
        assert first.tokens == want and first.usage.cache_read_tokens == 0
        r = ctl.generate(p, "", 6)  # no extra prompt: the cache covers the whole prompt
        assert r.tokens == want
        assert r.usage.cache_read_tokens == r.handle.cached_tokens - 1 == len(ids) - 1


def test_handle_reloads_from_disk_without_memory_and_runs_cold_after_release(backend,
                                                                               store_root):
    p = params()
    want = cold_tokens(backend, p, "Q?", 6)
    with LocalCacheController(backend, store_root, memory_entries=0) as ctl:
        h = ctl.prepare(p)
        r = ctl.generate(h, "Q?", 6)  # reports the cold prepare: written, not read
        assert r.tokens == want and r.usage.cache_write_tokens == h.cached_tokens
        again = ctl.generate(h, "Q?", 6)  # nothing in memory: reloaded from disk
        assert again.tokens == want and again.usage.cache_disk_tokens == h.cached_tokens
        ctl.release(h.ref)
        after = ctl.generate(h, "Q?", 6)
        assert after.tokens == want and after.usage.cache_read_tokens == 0


def test_explicit_params_win_over_the_handle_and_a_foreign_handle_runs_cold(backend,
                                                                            store_root, caplog):
    """Decision 1022: ``generate(handle, params=P)`` answers P; the handle's cache serves it
    only if the handle is P's entry. A handle prepared for other params is refused (one
    WARNING line, no id in it) and P runs cold -- never the other prompt's answer."""
    a = params()
    b = params(data=["Clause 9: the buyer may cancel within fourteen days of delivery. " * 4])
    volatile_tail = params(data=[DOC, {"content": "Today is Monday.", "cache": "volatile"}])
    with LocalCacheController(backend, store_root) as ctl:
        ha = ctl.prepare(a)
        with caplog.at_level("WARNING", logger="spoolctl.controllers"):
            r = ctl.generate(ha, "Q?", 6, params=b)
        assert r.tokens == cold_tokens(backend, b, "Q?", 6) and type(r) is GenerateResult
        assert r.usage.cache_read_tokens == 0
        assert "prepared for other params" in caplog.text and ha.ref[:8] not in caplog.text
        # Same cacheable prefix (only a volatile element differs): the same entry, used.
        # (The refused call did not consume the handle's cold prefill: this one reports it.)
        tail = ctl.generate(ha, "Q?", 6, params=volatile_tail)
        assert tail.tokens == cold_tokens(backend, volatile_tail, "Q?", 6)
        assert tail.usage.cache_write_tokens == ha.cached_tokens
        # Without params= the handle's own params are the query.
        own = ctl.generate(ha, "Q?", 6)
        assert own.tokens == cold_tokens(backend, a, "Q?", 6)
        assert own.usage.cache_read_tokens == ha.cached_tokens
        with pytest.raises(ConfigError, match="params twice"):
            ctl.generate(a, "Q?", 6, params=b)


def test_key_covers_tools_effort_formatter_but_not_tool_order(backend, store_root):
    t1 = {"name": "search", "description": "web search"}
    t2 = {"name": "calc", "description": "calculator"}
    with LocalCacheController(backend, store_root) as ctl:
        a = ctl.prepare(params(tools=[t1, t2]))
        b = ctl.prepare(params(tools=[t2, t1]))
        c = ctl.prepare(params(tools=[t1]))
        d = ctl.prepare(params(tools=[t1, t2], reasoning_effort="high"))
        e = ctl.prepare(params(tools=[t1, t2],
                               formatter_options={"chat_template_kwargs": {"x": 1}}))
        assert a.ref == b.ref and b.source == "memory"
        assert len({a.ref, c.ref, d.ref, e.ref}) == 4
        assert a.includes.tools and a.includes.instructions and a.includes.data_element_count == 1


def test_volatile_elements_are_never_cached(backend, store_root):
    with LocalCacheController(backend, store_root) as ctl:
        plain = ctl.prepare(params())
        tail = ctl.prepare(params(data=[DOC, {"content": "today is 2026-11-29",
                                               "cache": "volatile"}, "later doc"]))
        assert tail.ref == plain.ref and tail.includes.data_element_count == 1
        first_volatile = ctl.prepare(params(instructions=[{"content": "now", "cache": "volatile"}]))
        assert not first_volatile and first_volatile.ref is None
        r = ctl.generate(params(instructions=[{"content": "now", "cache": "volatile"}]), "Hi", 4)
        assert r.usage.cache_read_tokens == 0 and r.usage.prompt_tokens > 0
        # The empty handle of this controller's prepare still names its params: cold run.
        again = ctl.generate(first_volatile, "Hi", 4)
        assert again.tokens == r.tokens and again.usage.cache_read_tokens == 0
        with pytest.raises(ConfigError, match="not prepared by this controller"):
            ctl.generate(CacheHandle.empty(), "Hi", 4)


def test_release_takes_entry_out_of_reuse_and_close_deletes_it(backend, store_root):
    with LocalCacheController(backend, store_root) as ctl:
        a = ctl.prepare(params())
        b = ctl.prepare(params(data=["another document entirely, unrelated to invoices"]))
        ctl.release(a.ref)
        again = ctl.prepare(params(read_only=True))
        assert not again  # released: not reused even though the bytes are still there
    with Store.open(store_root) as s:
        assert s.row(a.ref) is None and s.row(b.ref) is not None


def test_managed_store_removed_on_close(backend):
    ctl = LocalCacheController(backend)
    root = ctl.store.root
    assert ctl.prepare(params()).source == "cold"
    assert root.exists()
    ctl.close()
    ctl.close()  # idempotent
    assert not root.exists()
    with pytest.raises(ConfigError):
        ctl.prepare(params())


def test_bad_input_is_one_clear_error(backend, store_root):
    with LocalCacheController(backend, store_root) as ctl:
        with pytest.raises(ConfigError):
            ctl.prepare({"model": "x"})  # type: ignore[arg-type]
        with pytest.raises(ConfigError):
            ctl.release("not-an-id")
        with pytest.raises(ConfigError):
            ctl.generate(params(), "x", 0)
    with pytest.raises(ConfigError):
        CachePrepareParams(model="m", reasoning_effort="extreme")


# -- pure helpers ----------------------------------------------------------------------------


def test_token_prefix_offsets_hashes_and_meta_round_trip():
    a = TokenPrefix.from_segments([[1, 2, 3], [4], [5, 6]])
    assert a.tokens == (1, 2, 3, 4, 5, 6) and a.offsets == (3, 4, 6)
    assert TokenPrefix.from_meta(a.to_meta()) == a
    b = TokenPrefix.from_segments([[1, 2, 3], [4], [7]])
    assert a.hashes[:2] == b.hashes[:2] and a.hashes[2] != b.hashes[2]
    assert common_prefix_tokens(a, b) == 4
    assert common_prefix_tokens(a, a) == 6
    # Ids decide, wherever they stop agreeing: inside a segment, or split differently.
    c = TokenPrefix.from_segments([[1, 2], [3, 4], [5, 6]])
    assert common_prefix_tokens(a, c) == 6
    d = TokenPrefix.from_segments([[1, 2, 3], [4, 5, 9, 9]])
    assert common_prefix_tokens(a, d) == common_prefix_tokens(d, a) == 5
    assert common_prefix_tokens(a, TokenPrefix.from_segments([[7]])) == 0
    assert a.is_prefix_of([1, 2, 3, 4, 5, 6, 9]) and not a.is_prefix_of([1, 2, 3])


@pytest.mark.parametrize("field, value", [
    ("tokens", [1, 2, 3, 4, 5, 7]),
    ("prefix_hashes", ["0" * 64] * 3),
    ("prefix_offsets", [3, 2, 6]),
    ("token_count", 5),
])
def test_token_prefix_rejects_tampered_meta(field, value):
    meta = TokenPrefix.from_segments([[1, 2, 3], [4], [5, 6]]).to_meta()
    meta[field] = value
    with pytest.raises(ValueError):
        TokenPrefix.from_meta(meta)


def test_rank_bases_prefers_most_shared_elements_in_the_same_group():
    rows = [
        ("a" * 64, "k1", {"group": "g", "elements": ["e1"], "tokens": 10}),
        ("b" * 64, "k2", {"group": "g", "elements": ["e1", "e2", "x"], "tokens": 30}),
        ("c" * 64, "k3", {"group": "other", "elements": ["e1", "e2", "e3"], "tokens": 30}),
        ("d" * 64, "k4", {"group": "g", "elements": ["z"], "tokens": 5}),
        ("e" * 64, "k5", {"group": "g", "elements": "garbage", "tokens": 5}),
    ]
    ranked = rank_bases(rows, group="g", elements=["e1", "e2", "e3"])
    assert [c.entry_id[0] for c in ranked] == ["b", "a"]
    assert ranked[0].shared_elements == 2
    # With a shared leading tools segment even an entry with no shared element qualifies.
    assert "d" in [c.entry_id[0] for c in rank_bases(rows, group="g", elements=["q"],
                                                     lead_segments=1)]


def test_rank_bases_finds_a_base_by_its_token_marks_without_a_shared_element():
    """One long message grown by a few ids shares no element with the stored one: its
    catalog marks confirm the shared leading ids, the longest confirmed ranks first, and
    ``whole_only`` keeps only rows whose whole ids are a prefix of the plan's."""
    stored = list(range(100, 180))  # 80 ids
    ours = PrefixDigests([*stored[:70], 1, 2, 3])
    grown = PrefixDigests([*stored, 1, 2])
    short = list(range(100, 120))  # 20 ids, a prefix of both
    rows = [
        ("a" * 64, "k1", {"group": "g", "elements": ["x"], "tokens": 80,
                          "marks": PrefixDigests(stored).marks()}),
        ("b" * 64, "k2", {"group": "g", "elements": ["y"], "tokens": 20,
                          "marks": PrefixDigests(short).marks()}),
        ("c" * 64, "k3", {"group": "g", "elements": ["z"], "tokens": 80,
                          "marks": PrefixDigests(list(range(80))).marks()}),
        ("d" * 64, "k4", {"group": "g", "elements": ["w"], "tokens": 80, "marks": "junk"}),
    ]
    assert sorted(PrefixDigests(stored).marks(), key=int) == ["16", "32", "64", "80"]
    ranked = rank_bases(rows, group="g", elements=["q"], prefix=ours)
    assert [(c.entry_id[0], c.shared_tokens, c.whole) for c in ranked] == \
        [("a", 64, False), ("b", 20, True)]
    whole = rank_bases(rows, group="g", elements=["q"], prefix=ours, whole_only=True)
    assert [c.entry_id[0] for c in whole] == ["b"]
    assert [(c.entry_id[0], c.whole) for c in rank_bases(
        rows, group="g", elements=["q"], prefix=grown, whole_only=True)] == \
        [("a", True), ("b", True)]
    # marks keyed for a tenant match no row of plain marks
    assert rank_bases(rows, group="g", elements=["q"],
                      prefix=PrefixDigests(stored[:70], key=str.upper)) == []


def test_background_puts_keep_order_drop_past_the_bound_and_close_writes_what_waits():
    """Checkpoint puts: in order on one worker, at most ``max_pending`` waiting (the rest
    dropped, never blocking the prepare), a failing put does not stop the worker, and
    ``close`` returns only once every queued put ran; nothing is taken after it."""
    import threading

    from spoolctl.controllers.local.background_puts import BackgroundPuts

    gate, done = threading.Event(), []

    def put(item: int) -> None:
        gate.wait(30)
        if item == 1:
            raise OSError("disk full")
        done.append(item)

    puts = BackgroundPuts(put, max_pending=3)
    assert [puts.submit(i) for i in range(5)] == [True, True, True, False, False]
    gate.set()
    puts.close()
    assert done == [0, 2]
    assert puts.submit(9) is False


def test_namespace_depends_on_every_identity_field():
    base = {"model": "/m", "dtype": "float32", "device": "cpu"}
    names = {namespace_for("pytorch", base),
             namespace_for("pytorch", {**base, "dtype": "bfloat16"}),
             namespace_for("pytorch", {**base, "device": "cuda"}),
             namespace_for("mlx", base)}
    assert len(names) == 4


def test_engine_and_cli_modules_import_no_framework():
    import subprocess
    import sys

    code = ("import sys, spoolctl.controllers, spoolctl.controllers.local.engine, spoolctl.demo, "
            "spoolctl.cli.prefill\n"
            "bad = [m for m in ('torch', 'transformers', 'mlx', 'safetensors')\n"
            "       if m in sys.modules]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_controller_is_importable_from_the_package_without_loading_its_framework():
    import subprocess
    import sys

    code = ("import sys, spoolctl.controllers as c, spoolctl.controllers.mlx.vlm\n"
            "bad = [m for m in ('torch', 'transformers', 'mlx', 'mlx_vlm', 'google.genai')\n"
            "       if m in sys.modules]\n"
            "assert not bad, bad\n"
            "names = ('PyTorchCacheController', 'MlxCacheController', 'MlxVlmCacheController',\n"
            "         'GoogleGenAICacheController')\n"
            "assert set(names) <= set(dir(c)), dir(c)\n"
            "from spoolctl.controllers import MlxVlmCacheController, PyTorchCacheController\n"
            "assert 'torch' not in sys.modules and 'mlx_vlm' not in sys.modules\n"
            "try:\n"
            "    c.NoSuchController\n"
            "except AttributeError:\n"
            "    pass\n"
            "else:\n"
            "    raise AssertionError('unknown names must raise AttributeError')\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    pytest.importorskip("google.genai")
    from spoolctl.controllers import GoogleGenAICacheController
    from spoolctl.controllers.genai.controller import GoogleGenAICacheController as direct

    assert GoogleGenAICacheController is direct


def test_warning_log_reasons_carry_no_path_file_name_or_id():
    """Decision 1023: every controller renders an exception for a default log line through
    ``logsafe.reason``: no store path, no file name, no id or digest."""
    from spoolctl.controllers.logsafe import reason
    from spoolctl.store import StoreIOError

    entry = "ab" * 32
    root = "/srv/spool/rank-0003"
    err = StoreIOError(f"cannot read the manifest of entry {entry}",
                       path=f"{root}/manifests/ab/{entry}.json", fix="run spoolctl scrub")
    assert reason(err) == "cannot read the manifest of entry <id>"
    oserr = FileNotFoundError(2, "No such file or directory", f"{root}/objects/ab/{entry}.obj")
    assert reason(oserr) == "FileNotFoundError: No such file or directory"
    long = ValueError("x" * 190 + entry)  # an id that the clip would cut into a fragment
    text = reason(long)
    assert len(text) <= 200 and "ab" * 4 not in text
