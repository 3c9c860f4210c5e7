"""MlxVlmCacheController end to end: real mlx-vlm on Linux CPU, a real store, a tiny
Qwen2-VL generated here (random weights, local tokenizer and processor config).

What a user relies on: text-only and image prompt caches written by one process are
reused by another with the same greedy tokens as a cold run; a different image, or
the same image resized differently, never reuses an entry; a corrupt snapshot is a
cold run and is quarantined; a text-only cache is never used for an image query.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the Qwen processor helper otherwise calls the hub
pytest.importorskip("mlx.core", reason="mlx is not installed; pip install 'spoolctl[vlm]'")
pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed; pip install 'spoolctl[vlm]'")
from PIL import Image

from spoolctl.controllers import CachePrepareParams, Element
from spoolctl.controllers.local.vlm_prompt import render_vlm
from spoolctl.controllers.mlx.vlm import (
    FORMAT,
    OBJECT_NAME,
    MlxVlmBackend,
    MlxVlmCacheController,
)
from spoolctl.store import Store

NEW = 8
SYSTEM = "You are a helpful assistant that looks at pictures and answers questions."
DOC = "The spool store keeps prompt caches on local disk with integrity."
ASK = "Describe the image. What colour is the square?"
QUESTION = "assistant: The picture shows"
SPOOLCTL = str(Path(sys.executable).parent / "spoolctl")


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from spoolctl.demo.tinyvlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl")


@pytest.fixture(scope="module")
def backend(vlm_dir: Path) -> MlxVlmBackend:
    return MlxVlmBackend(vlm_dir)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("images")
    out = {}
    for name, colour in (("red", (220, 20, 20)), ("blue", (20, 20, 220))):
        img = Image.new("RGB", (56, 56), (255, 255, 255))
        img.paste(Image.new("RGB", (28, 28), colour), (14, 14))
        out[name] = d / f"{name}.png"
        img.save(out[name])
    return out


def text_params(model: str, **kw) -> CachePrepareParams:
    return CachePrepareParams(model=model, instructions=[Element(SYSTEM, role="system")],
                              data=[Element(DOC, role="user")], **kw)


def image_params(model: str, image: Path, **kw) -> CachePrepareParams:
    return CachePrepareParams(model=model, instructions=[Element(SYSTEM, role="system")],
                              data=[Element(ASK, role="user")],
                              images=[{"source": str(image), "before": 1}], **kw)


def cold_tokens(backend: MlxVlmBackend, p: CachePrepareParams) -> list[int]:
    """Reference: greedy tokens of the whole prompt with no cache at all."""
    imgs = backend.load_images(p.images, p.max_image_size)
    text = render_vlm(p, p.images, backend.placeholder, include_volatile=True, prompt=QUESTION)
    out, reused = backend.generate(None, backend.encode(text, imgs), imgs, NEW)
    assert out and reused == 0
    return out


WRITER = """
import json, sys
from spoolctl.controllers import CachePrepareParams
from spoolctl.controllers.mlx.vlm import MlxVlmCacheController
model, root, specs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with MlxVlmCacheController(model, root) as ctl:
    out = []
    for spec in specs:
        h = ctl.prepare(CachePrepareParams(**spec))
        out.append({"ref": h.ref, "source": h.source, "tokens": h.cached_tokens})
print(json.dumps(out))
"""


def _spec(p: CachePrepareParams) -> dict:
    return {"model": p.model,
            "instructions": [{"role": e.role, "content": e.content} for e in p.instructions],
            "data": [{"role": e.role, "content": e.content} for e in p.data],
            "images": [{"source": i.source, "before": i.before} for i in p.images],
            "max_image_size": p.max_image_size}


def test_text_and_image_caches_survive_a_restart(backend, vlm_dir, images, tmp_path) -> None:
    root = tmp_path / "store"
    tp, ip = text_params(str(vlm_dir)), image_params(str(vlm_dir), images["red"])
    proc = subprocess.run([sys.executable, "-c", WRITER, str(vlm_dir), str(root),
                           json.dumps([_spec(tp), _spec(ip)])],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    written = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [w["source"] for w in written] == ["cold", "cold"]

    with MlxVlmCacheController(backend, root) as ctl:
        for p, w in ((tp, written[0]), (ip, written[1])):
            handle = ctl.prepare(p)
            assert handle.source == "disk" and handle.ref == w["ref"]
            assert handle.cached_tokens == w["tokens"] > 0 and handle.written_tokens == 0
            res = ctl.generate(handle, QUESTION, NEW)
            assert res.tokens == cold_tokens(backend, p)
            assert res.usage.cache_read_tokens == handle.cached_tokens
        text_m = ctl.store.manifest(written[0]["ref"])
        image_m = ctl.store.manifest(written[1]["ref"])
    # Separate namespaces and recorded image identity; spoolctl sees them as mlx entries.
    assert text_m.namespace != image_m.namespace
    assert text_m.meta["format"] == image_m.meta["format"] == FORMAT
    assert text_m.meta["vlm_mode"] == "text" and text_m.meta["image_count"] == 0
    meta = image_m.meta
    assert meta["vlm_mode"] == "image" and meta["image_count"] == 1
    assert meta["images"][0]["mode"] == "RGB" and meta["images"][0]["width"] == 56
    assert meta["images"][0]["before"] == 1
    assert meta["layout"]["snapshot_layout"] == "exact_cache_v1"
    listed = subprocess.run([SPOOLCTL, "ls", "--root", str(root), "--kind", "mlx", "--json"],
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    ids = {e["entry_id"] for e in json.loads(listed.stdout)["entries"]}
    assert ids == {written[0]["ref"], written[1]["ref"]}


def test_a_different_image_or_resize_never_reuses(backend, vlm_dir, images, tmp_path) -> None:
    root = tmp_path / "store"
    with MlxVlmCacheController(backend, root) as ctl:
        red = ctl.prepare(image_params(str(vlm_dir), images["red"]))
        assert red.source == "cold"
        blue_p = image_params(str(vlm_dir), images["blue"])
        blue = ctl.prepare(blue_p)
        assert blue.source == "cold" and blue.ref != red.ref
        assert ctl.generate(blue, QUESTION, NEW).tokens == cold_tokens(backend, blue_p)
        # Same file, resized differently before the processor: another entry.
        small_p = image_params(str(vlm_dir), images["red"], max_image_size=28)
        small = ctl.prepare(small_p)
        assert small.source == "cold" and small.ref not in (red.ref, blue.ref)
        assert ctl.store.manifest(small.ref).meta["images"][0]["width"] == 28
        assert ctl.store.manifest(small.ref).meta["max_image_size"] == 28
        assert ctl.generate(small, QUESTION, NEW).tokens == cold_tokens(backend, small_p)
        # The same path with other pixels (the file was replaced): a miss, not a stale hit.
        changed = tmp_path / "changed.png"
        changed.write_bytes(images["red"].read_bytes())
        first = ctl.prepare(image_params(str(vlm_dir), changed))
        Image.open(images["blue"]).save(changed)
        second_p = image_params(str(vlm_dir), changed)
        second = ctl.prepare(second_p)
        assert second.source == "cold" and second.ref != first.ref
        assert ctl.generate(second, QUESTION, NEW).tokens == cold_tokens(backend, second_p)
        # Five entries, four kept in memory: red comes back from disk, still a hit.
        assert ctl.prepare(image_params(str(vlm_dir), images["red"])).source == "disk"


def test_corrupt_snapshot_is_cold_and_quarantined(backend, vlm_dir, images, tmp_path) -> None:
    root = tmp_path / "store"
    p = image_params(str(vlm_dir), images["red"])
    with MlxVlmCacheController(backend, root, memory_entries=0) as ctl:
        handle = ctl.prepare(p)
        manifest = ctl.store.manifest(handle.ref)
        obj = ctl.store.layout.object_path(manifest.object(OBJECT_NAME).digest)
        data = bytearray(obj.read_bytes())
        data[len(data) // 2] ^= 0x40
        obj.write_bytes(bytes(data))
        res = ctl.generate(handle, QUESTION, NEW)
        assert res.usage.cache_read_tokens == 0
        assert res.tokens == cold_tokens(backend, p)
        items = ctl.store.quarantine_items()
        assert [i.entry_id for i in items] == [handle.ref]
        # The key is rebuilt cold and then served from disk again.
        assert ctl.prepare(p).source == "cold"
        assert ctl.prepare(p).source == "disk"


def test_entry_recorded_for_another_image_is_rejected(backend, vlm_dir, images,
                                                      tmp_path) -> None:
    """An entry filed under the blue query's key but holding the red image's snapshot
    and identity (a copied or inconsistent entry) is a miss and quarantined, even though
    its bytes verify: the recorded image identity must equal the query's."""
    root = tmp_path / "store"
    red_p = image_params(str(vlm_dir), images["red"])
    blue_p = image_params(str(vlm_dir), images["blue"])
    with MlxVlmCacheController(backend, root) as ctl:
        m = ctl.store.manifest(ctl.prepare(red_p).ref)
        blue_plan = ctl.format.plan(blue_p)
        objects = {k: bytes(v) for k, v in ctl.store.read_all(m).items()}
        forged = ctl.store.put(kind="mlx", namespace=blue_plan.namespace, key=blue_plan.key,
                               objects=objects, meta=dict(m.meta), index=dict(m.index))
        assert forged.entry_id == blue_plan.entry_id
    with MlxVlmCacheController(backend, root) as ctl:
        blue = ctl.prepare(blue_p)
        assert blue.source == "cold"
        assert [i.entry_id for i in ctl.store.quarantine_items()] == [forged.entry_id]
        assert ctl.generate(blue, QUESTION, NEW).tokens == cold_tokens(backend, blue_p)


def test_text_ref_is_refused_for_an_image_query(backend, vlm_dir, images, tmp_path) -> None:
    root = tmp_path / "store"
    tp = text_params(str(vlm_dir))
    # Same text as the image query, so only the mode (the image) tells them apart.
    ip = CachePrepareParams(model=tp.model, instructions=tp.instructions, data=tp.data,
                            images=[str(images["red"])])
    with MlxVlmCacheController(backend, root) as ctl:
        th = ctl.prepare(tp)
        res = ctl.generate(th, QUESTION, NEW, params=ip)
        assert res.usage.cache_read_tokens == 0
        assert res.tokens == cold_tokens(backend, ip)
        ih = ctl.prepare(ip)
        back = ctl.generate(ih, QUESTION, NEW, params=tp)
        assert back.usage.cache_read_tokens == 0
        assert back.tokens == cold_tokens(backend, tp)
        # The first use of ih reports its cold prepare (written); the next one reads it.
        assert ctl.generate(ih, QUESTION, NEW).usage.cache_write_tokens == ih.cached_tokens
        assert ctl.generate(ih, QUESTION, NEW).usage.cache_read_tokens == ih.cached_tokens
    assert th.ref != ih.ref


def test_vlm_entries_are_not_plain_mlx_lm_entries(backend, vlm_dir, tmp_path) -> None:
    from spoolctl.controllers.local.engine import FORMAT as PLAIN_FORMAT

    with MlxVlmCacheController(backend, tmp_path / "store") as ctl:
        h = ctl.prepare(text_params(str(vlm_dir)))
        meta = dict(ctl.store.manifest(h.ref).meta)
        assert meta["format"] != PLAIN_FORMAT
        with pytest.raises(ValueError, match="not an mlx-vlm entry"):
            ctl.format.check({**meta, "format": PLAIN_FORMAT}, None)


def test_prefill_cli_with_an_image(vlm_dir, images, tmp_path) -> None:
    root = tmp_path / "store"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    env.pop("SPOOLCTL_ROOT", None)

    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([SPOOLCTL, "prefill", "--backend", "mlx", "--model", str(vlm_dir),
                               "--root", str(root), "--prompt", ASK, "--json", *extra],
                              capture_output=True, text=True, timeout=300, env=env,
                              stdin=subprocess.DEVNULL)

    first = run("--image", str(images["red"]))
    assert first.returncode == 0, first.stderr
    doc = json.loads(first.stdout)
    assert doc["source"] == "cold" and doc["images"] == 1 and doc["tokens"] > 0
    again = run("--image", str(images["red"]))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["source"] == "disk"
    assert json.loads(again.stdout)["entry_id"] == doc["entry_id"]
    with Store.open(root) as store:
        assert store.manifest(doc["entry_id"]).meta["vlm_mode"] == "image"
    scrub = subprocess.run([SPOOLCTL, "scrub", "--root", str(root), "--json"],
                           capture_output=True, text=True, timeout=120, env=env)
    assert scrub.returncode == 0 and json.loads(scrub.stdout)["quarantined"] == []
    missing = run("--image", str(tmp_path / "nope.png"))
    assert missing.returncode == 2 and "nope.png" in missing.stderr


def test_read_only_never_writes_and_release_deletes_at_close(backend, vlm_dir, images,
                                                             tmp_path) -> None:
    root = tmp_path / "store"
    p = image_params(str(vlm_dir), images["red"])
    ro = image_params(str(vlm_dir), images["red"], read_only=True)
    with MlxVlmCacheController(backend, root) as ctl:
        assert not ctl.prepare(ro) and ctl.store.entries() == []
        handle = ctl.prepare(p)
        assert handle.source == "cold" and len(ctl.store.entries()) == 1
        ctl.release(handle.ref)
        assert not ctl.prepare(ro)  # released: out of reuse at once, even read-only
    with Store.open(root) as store:
        assert store.entries() == []


def test_default_logs_name_no_store_path_or_id(backend, vlm_dir, images, tmp_path,
                                               caplog) -> None:
    """Decision 1023: the VLM controller's warnings (a store too small to commit, a corrupt
    snapshot) say what happened, never the store path or an id (docs/SECURITY.md)."""
    import logging

    root = tmp_path / "store"
    p = image_params(str(vlm_dir), images["red"])
    caplog.set_level(logging.INFO)
    with MlxVlmCacheController(backend, root, max_bytes=4096) as ctl:  # < one snapshot
        small = ctl.prepare(p)
        assert small.source == "cold" and ctl.stats()["commit_failures"] == 1
        assert ctl.store.entries() == []
    with MlxVlmCacheController(backend, tmp_path / "big", memory_entries=0) as ctl:
        handle = ctl.prepare(p)
        manifest = ctl.store.manifest(handle.ref)
        obj = ctl.store.layout.object_path(manifest.object(OBJECT_NAME).digest)
        obj.write_bytes(obj.read_bytes()[:-9] + b"corrupted")
        assert ctl.generate(handle, QUESTION, NEW).usage.cache_read_tokens == 0
        ids = {small.ref, handle.ref, manifest.object(OBJECT_NAME).digest}
    text = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    assert "not persisted" in text and "treated as a miss" in text  # the paths ran
    assert str(tmp_path) not in text
    for value in ids:
        for i in range(len(value) - 7):
            assert value[i:i + 8] not in text, "an id fragment reached a default log"


def test_tenants_on_an_encrypted_store(backend, vlm_dir, images, tmp_path, monkeypatch,
                                       caplog) -> None:
    """``tenant=`` on an encrypted store (issue 33 item 6, decision 2821): the image entry is
    sealed with the tenant's key and no store file holds its token ids or image digests; the
    same tenant reuses it with tokens equal to a cold run, another tenant or none never does;
    after ``keys revoke`` it is a miss; a lost master key is one line, then misses."""
    pytest.importorskip("cryptography")
    import logging
    import secrets

    from operator_cli import run_json

    from spoolctl.store.sealing import COMMAND_ENV, FILE_ENV, MAGIC3, VALUE_ENV

    ip = image_params(str(vlm_dir), images["red"])
    want = cold_tokens(backend, ip)
    # What the entry's meta holds in clear on a plain store: none of it may show when sealed.
    with MlxVlmCacheController(backend, tmp_path / "plain") as ctl:
        plain = ctl.store.manifest(ctl.prepare(ip).ref).meta
    secrets_in_clear = [plain["image_digest"], plain["images"][0]["pixels"],
                        plain["extra_hash"], plain["layout"]["cache_hash"],
                        plain["layout"]["file_name"][6:-12],
                        json.dumps(plain["tokens"][:12])[1:-1]]

    for name in (FILE_ENV, VALUE_ENV, COMMAND_ENV):
        monkeypatch.delenv(name, raising=False)
    master = secrets.token_hex(32)
    monkeypatch.setenv(VALUE_ENV, master)
    root = tmp_path / "sealed"
    with MlxVlmCacheController(backend, root, tenant="acme") as ctl:
        first = ctl.generate(ip, QUESTION, NEW)
    assert first.handle.source == "cold" and first.tokens == want
    objects = list((root / "objects").rglob("*.obj"))
    # objects bound to their entry: SPS3 headers (decision 3020)
    assert objects and all(p.read_bytes()[:4] == MAGIC3 for p in objects)
    for path in (p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        for s in secrets_in_clear:
            assert s.encode() not in data, (path, s)
        assert b"acme" not in data, path

    with MlxVlmCacheController(backend, root, tenant="acme") as ctl:
        hit = ctl.generate(ip, QUESTION, NEW)
    assert hit.handle.source == "disk" and hit.tokens == want
    assert hit.handle.ref == first.handle.ref
    for other in ("globex", None):
        with MlxVlmCacheController(backend, root, tenant=other) as ctl:
            got = ctl.generate(ip, QUESTION, NEW)
        assert got.handle.source == "cold" and got.tokens == want, other
        assert got.handle.ref != first.handle.ref

    run_json("keys", "revoke", "--tenant-env", "SPOOLCTL_TENANT", "--yes", "--root", str(root),
             env={VALUE_ENV: master, "SPOOLCTL_TENANT": "acme",
                  # erased keys are recorded outside the store
                  "SPOOLCTL_KEY_LEDGER": str(root.parent / "erased-keys.json")})
    with MlxVlmCacheController(backend, root, tenant="acme") as ctl:
        again = ctl.generate(ip, QUESTION, NEW)
    assert again.handle.source == "cold" and again.tokens == want

    monkeypatch.setenv(VALUE_ENV, secrets.token_hex(32))  # the master key lost, replaced
    before = sorted(p.name for p in (root / "manifests").rglob("*.json"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spoolctl"), \
            MlxVlmCacheController(backend, root, tenant="acme") as ctl:
        lost = ctl.generate(ip, QUESTION, NEW)
    assert lost.handle.source == "cold" and lost.tokens == want
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "not the one this store's keyring" in lines[0], lines
    assert sorted(p.name for p in (root / "manifests").rglob("*.json")) == before
