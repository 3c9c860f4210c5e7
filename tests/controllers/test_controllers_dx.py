"""Issue #22, the developer's first hour with the local controllers (real torch/transformers
and mlx-lm on the tiny Llama, real stores):

1. wrong inputs fail loudly at construction (never split a string into characters, never
   cache an empty element, never accept another model's name); one model is one key;
2. usage tells the truth per call: tokens from memory, from disk, computed, written --
   for a cold run, a memory hit, a disk hit and an incremental prefill;
5. errors name the cause: CPU-only torch asked for CUDA, a closed controller, a
   read-only miss handed to generate, ``release(handle)``, a read-only controller.

Chat templates, decoding settings and interop are in ``test_controllers_interop.py``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from spoolctl.controllers import CacheHandle, CachePrepareParams, Element, LocalCacheController
from spoolctl.store import ConfigError, Store

SYSTEM = "You are a careful contracts assistant. Answer from the reference documents only."
DOC1 = "Clause 4.2: the supplier keeps every invoice for seven years. " * 5
DOC2 = "Clause 9: the buyer may cancel within fourteen days of delivery. " * 3
QUESTION = "Question: how long are invoices kept?"
NEW = 6


def make_backend(name: str, model_dir: Path, **kw):
    if name == "pytorch":
        from spoolctl.controllers.pytorch import PyTorchBackend

        return PyTorchBackend(model_dir, **kw)
    pytest.importorskip("mlx.core", reason="mlx is not installed here; pip install 'mlx-lm[cpu]'")
    from spoolctl.controllers.mlx import MlxBackend

    return MlxBackend(model_dir, **kw)


@pytest.fixture(scope="module", params=["pytorch", "mlx"])
def backend(request, tiny_model_dir):
    return make_backend(request.param, tiny_model_dir)


def p1(**kw) -> CachePrepareParams:
    return CachePrepareParams(instructions=[Element(SYSTEM, role="system")], data=[DOC1], **kw)


def p2(**kw) -> CachePrepareParams:
    return CachePrepareParams(instructions=[Element(SYSTEM, role="system")],
                              data=[DOC1, DOC2], **kw)


# -- 1. strict inputs -------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    ({"instructions": "Be brief."}, "instructions must be a list of elements, not a single str"),
    ({"data": "a long document"}, "data must be a list of elements"),
    ({"data": {"role": "user", "content": "x"}}, "not a single dict"),
    ({"data": Element("x")}, "not a single Element"),
    ({"tools": "search"}, "tools must be a list of tools"),
    ({"images": "photo.png"}, "images must be a list of images"),
    ({"data": 42}, "data must be a list of elements, not int"),
    ({"instructions": [""]}, "element content is empty"),
    ({"data": [{"role": "user"}]}, "a message has no 'content'"),
    ({"data": [{"role": "robot", "content": "x"}]}, "unknown element role"),
    ({"data": [{"content": "x", "cache": "forever"}]}, "unknown cache hint"),
    ({"model": "", "data": ["x"]}, "model must be a non-empty string"),
    ({"model": 3, "data": ["x"]}, "model must be a non-empty string"),
    ({"read_only": "yes"}, "read_only must be True or False"),
    ({"reasoning_effort": ["high"]}, "unknown reasoning_effort"),
    ({"formatter_options": {"style": "chatml"}}, "unknown formatter option"),
    ({"formatter_options": {"template": "jinja"}}, "unknown template"),
    ({"formatter_options": "plain"}, "formatter_options must be a dict"),
    ({"tools": [{"name": "f", "parameters": "{}"}]}, "parameters must be a JSON schema"),
    ({"tools": [{"name": "f", "args": {}}]}, "unknown tool fields"),
])
def test_wrong_inputs_fail_at_construction_with_one_clear_error(kwargs, match):
    with pytest.raises(ConfigError, match=match) as info:
        CachePrepareParams(**kwargs)
    assert info.value.fix  # every error says what to do


def test_accepted_spellings_are_one_key():
    base = CachePrepareParams(model="m", instructions=["Be brief."],
                              tools=[{"name": "f", "description": "d", "parameters": {}}])
    openai_style = CachePrepareParams(
        model="m", instructions=("Be brief.",),
        tools=[{"type": "function", "function": {"name": "f", "description": "d",
                                                 "parameters": {}}}])
    auto = CachePrepareParams(model="m", instructions=["Be brief."],
                              tools=base.tools, formatter_options={"template": "auto"})
    assert base.key() == openai_style.key() == auto.key()
    assert base.key() != CachePrepareParams(
        model="m", instructions=["Be brief."], tools=base.tools,
        formatter_options={"chat_template_kwargs": {"enable_thinking": False}}).key()
    assert CachePrepareParams(model=Path("/m"), data=["x"]).model == "/m"


def test_another_model_is_refused_and_every_spelling_of_the_model_is_one_entry(
        backend, tiny_model_dir, store_root, tmp_path):
    link = tmp_path / "model-link"
    link.symlink_to(tiny_model_dir)
    with LocalCacheController(backend, store_root) as ctl:
        assert ctl.model_id == str(tiny_model_dir.resolve())
        with pytest.raises(ConfigError, match="'gpt-4o' is not the model this controller runs"):
            ctl.prepare(p1().__class__(model="gpt-4o", data=[DOC1]))
        refs = {ctl.prepare(CachePrepareParams(model=m, data=[DOC1])).ref
                for m in (str(tiny_model_dir), str(tiny_model_dir) + "/", None, str(link),
                          os.path.relpath(tiny_model_dir))}
        assert len(refs) == 1
        assert len(ctl.store.entries()) == 1  # no duplicate entry for a trailing slash


def test_an_explicit_model_id_is_the_key(tiny_model_dir, store_root):
    backend = make_backend("pytorch", tiny_model_dir, model_id="acme/tiny-llama")
    with LocalCacheController(backend, store_root) as ctl:
        a = ctl.prepare(CachePrepareParams(model="acme/tiny-llama", data=[DOC1]))
        b = ctl.prepare(CachePrepareParams(model=str(tiny_model_dir), data=[DOC1]))
        assert a.ref == b.ref and ctl.identity["model"] == "acme/tiny-llama"
        with pytest.raises(ConfigError, match="not the model"):
            ctl.prepare(CachePrepareParams(model="acme/other", data=[DOC1]))


# -- 2. usage tells the truth --------------------------------------------------------------------


def expect(usage, *, prompt, memory=0, disk=0, written=0):
    got = usage.to_json()
    want = {"prompt_tokens": prompt, "cache_memory_tokens": memory, "cache_disk_tokens": disk,
            "cache_read_tokens": memory + disk, "computed_tokens": prompt - memory - disk,
            "cache_write_tokens": written}
    assert {k: got[k] for k in want} == want


def test_usage_for_cold_memory_disk_and_incremental(backend, store_root):
    """The documented pattern (prepare, then generate(handle)) and generate(params) report
    what each call did: cold computes and writes the prefix, a memory hit reads it from
    memory, a new controller reads it from disk, an incremental prefill reads the base
    and computes + writes only the suffix."""
    with LocalCacheController(backend, store_root) as ctl:
        n1, n2 = len(ctl.prefix_tokens(p1())), len(ctl.prefix_tokens(p2()))
        q1, q2 = len(ctl.prompt_tokens(p1(), QUESTION)), len(ctl.prompt_tokens(p2(), QUESTION))
        cold = ctl.prepare(p1())
        assert (cold.source, cold.computed_tokens, cold.written_tokens) == ("cold", n1, n1)
        first = ctl.generate(cold, QUESTION, NEW)
        expect(first.usage, prompt=q1, written=n1)
        expect(ctl.generate(cold, QUESTION, NEW).usage, prompt=q1, memory=n1)  # reported once
        hit = ctl.prepare(p1())
        assert hit.source == "memory" and hit.computed_tokens == hit.written_tokens == 0
        expect(ctl.generate(hit, QUESTION, NEW).usage, prompt=q1, memory=n1)
        expect(ctl.generate(p1(), QUESTION, NEW).usage, prompt=q1, memory=n1)
    with LocalCacheController(backend, store_root) as ctl:  # as after a restart
        disk = ctl.prepare(p1())
        assert disk.source == "disk"
        result = ctl.generate(disk, QUESTION, NEW)
        expect(result.usage, prompt=q1, disk=n1)
        assert result.tokens == first.tokens
    with LocalCacheController(backend, store_root) as ctl:  # base on disk, suffix computed
        grown = ctl.prepare(p2())
        assert (grown.source, grown.reused_tokens, grown.written_tokens) == \
            ("incremental", n1, n2 - n1)
        expect(ctl.generate(grown, QUESTION, NEW).usage, prompt=q2, disk=n1, written=n2 - n1)
    with LocalCacheController(backend, store_root / "fresh") as ctl:  # generate(params), cold
        expect(ctl.generate(p1(), QUESTION, NEW).usage, prompt=q1, written=n1)
        # base in memory this time
        expect(ctl.generate(p2(), QUESTION, NEW).usage, prompt=q2, memory=n1, written=n2 - n1)


def test_coalesced_callers_read_from_memory_and_the_work_counts_once(backend, store_root):
    import threading

    barrier = threading.Barrier(4)
    results = []
    with LocalCacheController(backend, store_root) as ctl:
        n = len(ctl.prefix_tokens(p1()))

        def worker():
            barrier.wait()
            results.append(ctl.generate(ctl.prepare(p1()), QUESTION, NEW).usage)

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sum(u.cache_write_tokens for u in results) == n
    assert sorted(u.cache_memory_tokens for u in results) == [0, n, n, n]


# -- 5. errors that point at the cause -------------------------------------------------------------


def test_cuda_on_a_cpu_only_torch_is_one_clear_error(tiny_model_dir):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    from spoolctl.controllers.pytorch import PyTorchCacheController

    with pytest.raises(ConfigError, match="device 'cuda' is not available") as info:
        PyTorchCacheController(tiny_model_dir, device="cuda")
    assert "device='cpu'" in info.value.fix


def test_a_closed_controller_says_so(backend, store_root):
    ctl = LocalCacheController(backend, store_root)
    handle = ctl.prepare(p1())
    ctl.close()
    for use in (lambda: ctl.store, lambda: ctl.store.entries(), lambda: ctl.prepare(p1()),
                lambda: ctl.generate(handle, QUESTION, NEW), lambda: ctl.restore(handle),
                lambda: ctl.release(handle)):
        with pytest.raises(ConfigError, match="controller is closed"):
            use()


def test_release_takes_a_handle_or_its_ref(backend, store_root):
    with LocalCacheController(backend, store_root) as ctl:
        a, b = ctl.prepare(p1()), ctl.prepare(p2())
        ctl.release(a)  # the handle itself
        ctl.release(b.ref)
        ctl.release(CacheHandle.empty())  # nothing to release
        with pytest.raises(ConfigError, match="takes a CacheHandle or its ref, not int"):
            ctl.release(42)  # type: ignore[arg-type]
        with pytest.raises(ConfigError):
            ctl.release("not-an-id")
        assert {r.hint for r in ctl.store.entries()} == {"release"}


def test_a_read_only_miss_handle_runs_cold_in_generate(backend, store_root):
    with LocalCacheController(backend, store_root) as ctl:
        want = ctl.generate(p1(), QUESTION, NEW).tokens
    with LocalCacheController(backend, store_root / "empty") as ctl:
        miss = ctl.prepare(p1(read_only=True))
        assert not miss and miss.source == "none"
        result = ctl.generate(miss, QUESTION, NEW)  # was "not prepared by this controller"
        assert result.tokens == want and result.usage.cache_read_tokens == 0
        assert result.usage.cache_write_tokens == 0 and ctl.store.entries() == []


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and its size and mtime; SQLite's shared-memory index is rewritten by
    readers and not counted."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file() and not p.name.endswith("-shm")}


def test_a_read_only_controller_never_writes(backend, store_root):
    with LocalCacheController(backend, store_root) as ctl:
        want = ctl.generate(p1(), QUESTION, NEW).tokens
    ctl = LocalCacheController(backend, store_root, read_only=True)
    before = snapshot(store_root)
    with ctl:
        hit = ctl.prepare(p1())  # read_only is implied by the controller
        assert hit.source == "disk"
        assert ctl.generate(hit, QUESTION, NEW).tokens == want
        miss = ctl.prepare(CachePrepareParams(data=["an unrelated document"]))
        assert not miss
        assert ctl.generate(miss, QUESTION, NEW).usage.cache_write_tokens == 0
        with pytest.raises(ConfigError, match="read-only"):
            ctl.release(hit)
        with pytest.raises(ConfigError, match="read-only"):
            ctl.import_cache(p1(), ctl.restore(hit).cache)
        # (Closing the store is the store's business: its read-only mode, issue #22 store side.)
        assert snapshot(store_root) == before
    with Store.open(store_root) as s:
        assert [r.hint for r in s.entries()] == ["retain"]
    with pytest.raises(ConfigError, match="needs an existing store"):
        LocalCacheController(backend, None, read_only=True)


def test_a_read_only_controller_reads_a_store_it_cannot_write(backend, mount_tmpfs):
    """A developer reading a cache someone else wrote: the files are readable, nothing in
    the store can be written (a read-only filesystem: even root cannot write there)."""
    mnt = mount_tmpfs("64m")
    root = mnt / "store"
    with LocalCacheController(backend, root) as ctl:
        want = ctl.generate(p1(), QUESTION, NEW).tokens
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    with LocalCacheController(backend, root, read_only=True) as ctl:
        hit = ctl.prepare(p1())
        assert hit.source == "disk"
        result = ctl.generate(hit, QUESTION, NEW)
        assert result.tokens == want and result.usage.cache_disk_tokens == hit.cached_tokens
        assert not ctl.prepare(p2())  # a miss, not an error
