"""MlxCacheController end to end: real mlx-lm on CPU, a real store, the tiny Llama.

What a user relies on: a cache prepared before a restart is reused after it with
the same greedy tokens as a cold run; incremental prefill equals cold; corrupt or
incompatible entries are misses (cold path), never crashes or wrong tokens.
Release/close semantics shared with PyTorch live in test_controller_contract.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import mlx.core  # noqa: F401
except ImportError as exc:  # pragma: no cover - only where mlx cannot be installed
    pytest.skip(f"mlx is not installed here ({exc}); pip install 'mlx-lm[cpu]'",
                allow_module_level=True)

from spoolctl.controllers import CachePrepareParams, Element
from spoolctl.controllers.contract import render_segments
from spoolctl.controllers.mlx import MlxBackend, MlxCacheController
from spoolctl.store import Store

NEW = 16
DOC_A = "The spool store keeps prompt caches on local disk with integrity and bounded capacity."
DOC_B = "Crash safety means an entry is complete or absent after a power cut, never half written."
DOC_C = "Cache hits return identical greedy tokens; a corrupt byte is detected and quarantined."
QUESTION = "Question: what happens to a corrupt byte?"


def params(model: str, *data: str, **kw) -> CachePrepareParams:
    return CachePrepareParams(
        model=model,
        instructions=[Element("You are a helpful assistant. Use the documents.", role="system")],
        data=[Element(d, role="user") for d in data], **kw)


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> MlxBackend:
    return MlxBackend(tiny_model_dir)


def cold_tokens(backend: MlxBackend, p: CachePrepareParams, prompt: str = QUESTION) -> list[int]:
    """Reference: greedy tokens of the whole prompt with no cache at all."""
    segments = render_segments(p, include_volatile=True) + ([prompt] if prompt else [])
    ids = [t for s in backend.tokenize_segments(segments) for t in s]
    out = backend.generate(None, 0, ids, NEW)
    assert out, "the reference run produced no tokens"
    return out


def test_prepare_commits_an_mlx_entry_and_reuses_it(backend, tmp_path: Path) -> None:
    p = params(str(backend.model_dir), DOC_A, DOC_B)
    root = tmp_path / "store"
    with MlxCacheController(backend, root) as ctl:
        h = ctl.prepare(p)
        assert h and h.source == "cold" and h.cached_tokens > 0
        assert h.written_tokens == h.cached_tokens and h.reused_tokens == 0
        result = ctl.generate(h, QUESTION, NEW)  # reports the cold prepare
        assert result.tokens == cold_tokens(backend, p)
        assert result.usage.cache_read_tokens == 0
        assert result.usage.cache_write_tokens == h.cached_tokens
        assert result.usage.prompt_tokens > h.cached_tokens
        assert ctl.generate(h, QUESTION, NEW).usage.cache_memory_tokens == h.cached_tokens
        assert ctl.prepare(p).source == "memory"
    with Store.open(root) as store:
        rows = store.entries(kind="mlx")
        assert [r.entry_id for r in rows] == [h.ref]
        manifest = store.verify(h.ref)  # what `spoolctl scrub` does to every entry
        assert manifest.kind == "mlx"
        meta = manifest.meta
        assert meta["identity"]["mlx_lm_version"] == backend.mlx_lm_version
        assert meta["layout"]["format"] == backend.format
        assert meta["token_count"] == h.cached_tokens == len(meta["tokens"])
        assert meta["prefix_offsets"][-1] == h.cached_tokens
        assert len(meta["prefix_hashes"]) == len(meta["prefix_offsets"])


_RESTART = r"""
import json, sys
from spoolctl.controllers import CachePrepareParams
from spoolctl.controllers.mlx import MlxCacheController
model, root, p, question, new = sys.argv[1:]
p = CachePrepareParams(**json.loads(p))
with MlxCacheController(model, root) as ctl:
    h = ctl.prepare(p)
    r = ctl.generate(h, question, int(new))
    print(json.dumps({"source": h.source, "ref": h.ref, "cached": h.cached_tokens,
                      "tokens": r.tokens, "read": r.usage.cache_read_tokens}))
"""


def _run_process(model: Path, root: Path, p: dict) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    out = subprocess.run([sys.executable, "-c", _RESTART, str(model), str(root), json.dumps(p),
                          QUESTION, str(NEW)], check=True, capture_output=True, text=True,
                         env=env, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_restart_reuses_the_cache_with_cold_tokens(backend, tiny_model_dir: Path,
                                                   tmp_path: Path) -> None:
    # No "model": the controller's own (what a local app usually means).
    raw = {"instructions": ["You are a helpful assistant."], "data": [DOC_A, DOC_B, DOC_C]}
    root = tmp_path / "store"
    first = _run_process(tiny_model_dir, root, raw)
    second = _run_process(tiny_model_dir, root, raw)  # a new process: nothing in memory
    assert first["source"] == "cold" and second["source"] == "disk"
    assert second["ref"] == first["ref"] and second["read"] == first["cached"] > 0
    expected = cold_tokens(backend, CachePrepareParams(**raw))
    assert first["tokens"] == expected
    assert second["tokens"] == expected


def test_incremental_prefill_equals_cold(backend, tmp_path: Path) -> None:
    model = str(backend.model_dir)
    base_p = params(model, DOC_A, DOC_B)
    grown = params(model, DOC_A, DOC_B, DOC_C)
    with MlxCacheController(backend, tmp_path / "store") as ctl:
        base = ctl.prepare(base_p)
        base_ref, base_tokens = base.ref, base.cached_tokens
        del base  # nobody holds the base any more: it is superseded at once (decision 2100)
        h = ctl.prepare(grown)
        assert h.source == "incremental" and h.supersedes == base_ref
        assert h.reused_tokens == base_tokens
        assert h.written_tokens == h.cached_tokens - base_tokens > 0
        assert ctl.generate(h, QUESTION, NEW).tokens == cold_tokens(backend, grown)
        row = ctl.store.row(base_ref)
        assert row is not None and row.hint == "release"  # superseded: out of reuse
        assert ctl.store.row(h.ref).hint == "retain"
        assert ctl.store.manifest(h.ref).supersedes == base_ref
    with Store.open(tmp_path / "store") as store:
        assert store.row(base_ref) is None  # close() deleted the superseded base
        loaded_meta = store.verify(h.ref).meta
        assert loaded_meta["token_count"] == h.cached_tokens


def test_incremental_from_a_diverging_base_trims_to_the_common_prefix(backend,
                                                                      tmp_path: Path) -> None:
    model = str(backend.model_dir)
    first = params(model, DOC_A, DOC_B)
    other = params(model, DOC_A, DOC_C)  # shares instructions and DOC_A only
    with MlxCacheController(backend, tmp_path / "store") as ctl:
        base = ctl.prepare(first)
        h = ctl.prepare(other)
        # A sibling, not an extension: the base stays (decision 2100).
        assert h.source == "incremental" and h.supersedes is None
        assert 0 < h.reused_tokens < base.cached_tokens
        assert h.reused_tokens + h.written_tokens == h.cached_tokens
        assert ctl.generate(h, QUESTION, NEW).tokens == cold_tokens(backend, other)
    # After a restart both entries serve from disk with the same tokens.
    with MlxCacheController(backend, tmp_path / "store") as ctl:
        again = ctl.prepare(other)
        assert again.source == "disk" and again.ref == h.ref
        assert ctl.generate(again, QUESTION, NEW).tokens == cold_tokens(backend, other)
        assert ctl.prepare(first).source == "disk"


def test_a_prompt_inside_or_past_a_stored_message_reuses_every_shared_token(
        tiny_model_dir: Path, store_root: Path) -> None:
    """Full attention, the common-prefix rule (``family_prompts.check_common_prefix_rule``):
    a prompt that stops inside a stored document, and one that extends it inside its
    message, reuse every leading id they share with it, not only the instructions."""
    from family_prompts import check_common_prefix_rule

    check_common_prefix_rule(MlxCacheController, MlxBackend(tiny_model_dir, model_id="tiny"),
                             "tiny", store_root)


def test_cache_covering_the_whole_prompt_gives_cold_tokens(backend, tmp_path: Path) -> None:
    p = params(str(backend.model_dir), DOC_A)
    with MlxCacheController(backend, tmp_path / "store") as ctl:
        h = ctl.prepare(p)
        ctl.generate(h, "", NEW)  # the first call reports the cold prepare
        result = ctl.generate(h, "", NEW)  # the prompt is exactly the cached prefix
        assert result.tokens == cold_tokens(backend, p, prompt="")
        assert result.usage.cache_read_tokens == h.cached_tokens - 1


def _object_path(store: Store, ref: str) -> Path:
    manifest = store.manifest(ref)
    return store.layout.object_path(manifest.object("kv").digest)


def test_corrupt_payload_is_a_cold_miss_and_quarantined(backend, tmp_path: Path) -> None:
    p = params(str(backend.model_dir), DOC_A, DOC_B)
    root = tmp_path / "store"
    with MlxCacheController(backend, root) as ctl:
        ref = ctl.prepare(p).ref
    with Store.open(root) as store:
        path = _object_path(store, ref)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # one flipped bit inside the KV tensors
    os.chmod(path, 0o600)
    path.write_bytes(bytes(data))
    with MlxCacheController(backend, root) as ctl:
        h = ctl.prepare(p)
        assert h.source == "cold" and h.ref == ref  # rebuilt, not served
        assert ctl.generate(h, QUESTION, NEW).tokens == cold_tokens(backend, p)
        items = ctl.store.quarantine_items()
        assert [i.entry_id for i in items] == [ref]
        assert items[0].reason == "payload_digest"
        assert ctl.stats()["load_failures"] == 1
        ctl.store.verify(ref)  # the rebuilt entry is healthy


def _forge(root: Path, ref: str, edit) -> None:
    """Replace entry ``ref`` with one whose manifest meta was changed by ``edit``."""
    with Store.open(root) as store:
        m = store.manifest(ref)
        objects = {k: bytes(v) for k, v in store.read_all(m).items()}
        meta = json.loads(json.dumps(dict(m.meta)))
        edit(meta, objects)
        store.release(ref)
        store.clean_released()
        forged = store.put(kind=m.kind, namespace=m.namespace, key=m.key, objects=objects,
                           meta=meta, index=dict(m.index))
        assert forged.entry_id == ref


def test_other_mlx_lm_cache_format_is_a_cold_miss(backend, tmp_path: Path) -> None:
    p = params(str(backend.model_dir), DOC_A, DOC_B)
    root = tmp_path / "store"
    with MlxCacheController(backend, root) as ctl:
        ref = ctl.prepare(p).ref

    def older_format(meta, objects):
        meta["layout"]["format"] = "mlx-lm-prompt-cache/0.31"
        meta["layout"]["mlx_lm_version"] = "0.31.0"

    _forge(root, ref, older_format)
    with MlxCacheController(backend, root) as ctl:
        h = ctl.prepare(p)
        assert h.source == "cold"  # not "disk": the old-format bytes were never loaded
        assert ctl.generate(h, QUESTION, NEW).tokens == cold_tokens(backend, p)
        assert ctl.stats()["load_failures"] == 1
        # The unusable entry is set aside and the key rebuilt in the current format.
        items = ctl.store.quarantine_items()
        assert [i.entry_id for i in items] == [ref]
        assert "format 'mlx-lm-prompt-cache/0.31'" in items[0].detail  # rejected for that
        assert ctl.store.manifest(ref).meta["layout"]["format"] == backend.format
    with MlxCacheController(backend, root) as ctl:
        assert ctl.prepare(p).source == "disk"


def test_whole_buffer_payload_with_a_valid_digest_is_a_cold_miss(backend, tmp_path: Path) -> None:
    # Bytes that verify against their digest but do not match the layout (here: mlx-lm's
    # full 256-token buffer) must never reach the model.
    import io

    from mlx_lm.models.cache import save_prompt_cache

    p = params(str(backend.model_dir), DOC_A)
    root = tmp_path / "store"
    with MlxCacheController(backend, root) as ctl:
        h = ctl.prepare(p)
        ref, n = h.ref, h.cached_tokens

    def whole_buffer(meta, objects):
        cache = backend.prefill(None, meta["tokens"])
        buf = io.BytesIO()
        save_prompt_cache(buf, cache, {"spoolctl_format": backend.format})
        objects["kv"] = buf.getvalue()

    _forge(root, ref, whole_buffer)
    with MlxCacheController(backend, root) as ctl:
        h = ctl.prepare(p)
        assert h.source == "cold" and h.cached_tokens == n
        assert "has shape [1, 2, 256, " in ctl.store.quarantine_items()[0].detail
        assert ctl.generate(h, QUESTION, NEW).tokens == cold_tokens(backend, p)


def test_another_model_never_reuses_the_entry(backend, tiny_model_dir: Path,
                                              tmp_path: Path) -> None:
    import shutil

    p = params("tiny", DOC_A)  # one model id for both: only the namespace tells them apart
    root = tmp_path / "store"
    with MlxCacheController(tiny_model_dir, root, model_id="tiny") as ctl:
        first = ctl.prepare(p)
    other_dir = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other_dir)
    cfg = json.loads((other_dir / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5  # a different model with identical shapes
    (other_dir / "config.json").write_text(json.dumps(cfg))
    with MlxCacheController(other_dir, root, model_id="tiny") as ctl:
        h = ctl.prepare(p)
        assert h.source == "cold" and h.ref != first.ref
    with Store.open(root) as store:
        assert len({r.namespace for r in store.entries(kind="mlx")}) == 2


def test_read_only_never_writes(backend, tmp_path: Path) -> None:
    p = params(str(backend.model_dir), DOC_A, read_only=True)
    with MlxCacheController(backend, tmp_path / "store") as ctl:
        h = ctl.prepare(p)
        assert not h
        assert ctl.store.entries(kind="mlx") == []
        assert ctl.generate(p, QUESTION, NEW).tokens == cold_tokens(backend, p)


def test_model_path_controller_builds_its_own_backend(tiny_model_dir: Path) -> None:
    with MlxCacheController(tiny_model_dir) as ctl:  # managed temporary store
        assert ctl.kind == "mlx" and isinstance(ctl.backend, MlxBackend)
        managed = ctl.store.root
        assert ctl.prepare(params(str(tiny_model_dir) + "/", DOC_A)).source == "cold"
    assert not managed.exists()


def test_concurrent_prepares_from_threads_coalesce(backend, tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    p = params(str(backend.model_dir), DOC_A, DOC_C)
    with MlxCacheController(backend, tmp_path / "store") as ctl:
        def run(_):
            h = ctl.prepare(p)
            return h.ref, ctl.generate(h, QUESTION, NEW).tokens

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(run, range(4)))
        assert len({ref for ref, _ in results}) == 1
        assert all(tokens == cold_tokens(backend, p) for _, tokens in results)
        stats = ctl.stats()
        assert stats["cold_prefills"] == 1  # one prefill, the other callers shared it
        assert stats["queries"] == 4
        assert len(ctl.store.entries(kind="mlx")) == 1
