"""The weights digest and LoRA chain keys, without an engine (decisions 2110, 2111).
The real-engine proof is ``test_vllm_weights.py``."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from spoolctl.connector.deployment.identity import DeploymentIdentity
from spoolctl.connector.deployment.settings import parse_settings
from spoolctl.connector.deployment.weights import AdapterDigests, weights_digest
from spoolctl.connector.planning.chain import chain_root, chunk_keys
from spoolctl.connector.scheduler_side.lookup import Bypass, request_keys
from spoolctl.store import ConfigError


def _model(path: Path, weights: bytes = b"w" * 4096) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"hidden_size": 128}')
    (path / "model.safetensors").write_bytes(weights)
    return path


def _rewrite_keeping_mtime(path: Path, data: bytes) -> None:
    """Overwrite in place (same inode and size) and put the old mtime back."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == \
        (st.st_ino, st.st_size, st.st_mtime_ns)


def test_other_weights_at_the_same_path_are_another_digest_even_with_the_old_mtime(
        tmp_path: Path) -> None:
    model, memo = _model(tmp_path / "m"), tmp_path / "memo"
    first = weights_digest(model, memo_dir=memo)
    _rewrite_keeping_mtime(model / "model.safetensors", b"v" * 4096)  # only ctime tells
    second = weights_digest(model, memo_dir=memo)
    assert second.digest != first.digest
    assert second.hashed_bytes == 4096 and second.memo_hits == 1  # config.json remembered
    assert second.digest == weights_digest(model, memo_dir=None).digest  # a full rehash


def test_unchanged_files_are_not_read_again(tmp_path: Path) -> None:
    model, memo = _model(tmp_path / "m"), tmp_path / "memo"
    first = weights_digest(model, memo_dir=memo)
    assert first.hashed_bytes == first.bytes > 0
    again = weights_digest(model, memo_dir=memo)
    assert again.digest == first.digest
    assert again.hashed_bytes == 0 and again.memo_hits == again.files == 2


def test_a_copy_elsewhere_has_the_same_digest_and_a_renamed_file_another(
        tmp_path: Path) -> None:
    a = weights_digest(_model(tmp_path / "a"), memo_dir=None).digest
    assert weights_digest(_model(tmp_path / "b"), memo_dir=None).digest == a
    os.rename(tmp_path / "b" / "model.safetensors", tmp_path / "b" / "model2.safetensors")
    assert weights_digest(tmp_path / "b", memo_dir=None).digest != a


def test_a_memo_others_can_write_is_ignored(tmp_path: Path) -> None:
    model, memo = _model(tmp_path / "m"), tmp_path / "memo"
    weights_digest(model, memo_dir=memo)
    [memo_file] = memo.glob("*.json")
    memo_file.chmod(0o666)  # anyone could have forged it: never trusted
    assert weights_digest(model, memo_dir=memo).hashed_bytes == 4096 + len('{"hidden_size": 128}')
    memo_file.chmod(0o600)
    memo.chmod(0o777)  # nor a memo directory others can write
    assert weights_digest(model, memo_dir=memo).memo_hits == 0


def test_a_forged_memo_record_for_changed_weights_is_not_believed(tmp_path: Path) -> None:
    """The memo records the file identity with its digest; a record that does not match the
    file's current identity (here: an old record kept by a restored backup) is rehashed."""
    model, memo = _model(tmp_path / "m"), tmp_path / "memo"
    old = weights_digest(model, memo_dir=memo).digest
    [memo_file] = memo.glob("*.json")
    saved = memo_file.read_bytes()
    _rewrite_keeping_mtime(model / "model.safetensors", b"v" * 4096)
    memo_file.write_bytes(saved)
    assert weights_digest(model, memo_dir=memo).digest != old


def _hub_snapshot(cache: Path, files: dict[str, bytes]) -> Path:
    """A Hugging Face hub cache layout: snapshot symlinks to content-named blobs."""
    repo = cache / "models--org--tiny"
    snap = repo / "snapshots" / ("c" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    return snap


def test_hub_cache_files_are_named_by_their_blob_hash_without_reading(tmp_path: Path) -> None:
    snap = _hub_snapshot(tmp_path / "hub", {"config.json": b"{}", "model.safetensors": b"w" * 99})
    found = weights_digest(snap, memo_dir=tmp_path / "memo")
    assert found.hub_files == 2 and found.hashed_bytes == 0
    other = _hub_snapshot(tmp_path / "hub2", {"config.json": b"{}",
                                              "model.safetensors": b"v" * 99})
    assert weights_digest(other, memo_dir=None).digest != found.digest


def test_no_files_or_no_directory_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no files"):
        weights_digest(tmp_path / "empty", memo_dir=None)
    with pytest.raises(ConfigError, match="spoolctl_weights_id"):
        weights_digest(tmp_path / "missing", memo_dir=None)


def test_fifo_in_a_model_directory_is_never_opened(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    os.mkfifo(model / "pipe")
    assert weights_digest(model, memo_dir=None).files == 2  # would block if opened


def test_the_weights_are_part_of_the_namespace() -> None:
    ident = DeploymentIdentity(model="/m", revision=None, dtype="float32",
                               kv_cache_dtype="auto", block_size=32, kv_layout=(), tp_size=1,
                               pp_size=1, tp_rank=0, pp_rank=0, engine="vllm-0.32/cpu",
                               chunk_tokens=64)
    a = DeploymentIdentity(**{**ident.__dict__, "weights": "blake3:" + "a" * 64})
    b = DeploymentIdentity(**{**ident.__dict__, "weights": "blake3:" + "b" * 64})
    assert len({ident.namespace, a.namespace, b.namespace}) == 3
    assert a.summary()["weights"] == "blake3:" + "a" * 64


def test_weights_settings_are_validated() -> None:
    s = parse_settings({"spoolctl_root": "/r", "spoolctl_weights_id": "release-7",
                        "spoolctl_weights_memo": "off"}, block_size=32)
    assert (s.weights_id, s.weights_memo) == ("release-7", "off")
    with pytest.raises(ConfigError, match="absolute"):
        parse_settings({"spoolctl_root": "/r", "spoolctl_weights_memo": "rel"}, block_size=32)
    with pytest.raises(ConfigError, match="empty"):
        parse_settings({"spoolctl_root": "/r", "spoolctl_weights_id": " "}, block_size=32)


def test_a_model_without_local_files_refuses_to_start_unless_named() -> None:
    from spoolctl.connector.vllm_api.introspect import model_weights

    cfg = SimpleNamespace(model_config=SimpleNamespace(model="/no/such/model", revision=None))
    settings = parse_settings({"spoolctl_root": "/r"}, block_size=32)
    with pytest.raises(ConfigError, match="spoolctl_weights_id"):
        model_weights(cfg, settings)
    named = parse_settings({"spoolctl_root": "/r", "spoolctl_weights_id": "r7"}, block_size=32)
    assert model_weights(cfg, named) == "id:r7"


def _request(tokens: list[int], lora: object = None) -> SimpleNamespace:
    return SimpleNamespace(prompt_token_ids=tokens, lora_request=lora, cache_salt=None,
                           kv_transfer_params=None, prompt_embeds=None, mm_features=None)


def test_lora_requests_are_keyed_by_the_adapter_content(tmp_path: Path) -> None:
    ad1 = _model(tmp_path / "ad1", b"a" * 512)
    ad2 = _model(tmp_path / "ad2", b"b" * 512)
    adapters = AdapterDigests(tmp_path / "memo")
    tokens = list(range(130))

    def keys(lora: object) -> list[str]:
        return request_keys(_request(tokens, lora), namespace="ns", chunk_tokens=64,
                            adapters=adapters)

    base = keys(None)
    assert base == chunk_keys(chain_root("ns", None), tokens, 64)  # base keys unchanged
    one = keys(SimpleNamespace(lora_path=str(ad1)))
    same_content = keys(SimpleNamespace(lora_path=str(_model(tmp_path / "copy", b"a" * 512))))
    two = keys(SimpleNamespace(lora_path=str(ad2)))
    assert one == same_content and len({base[0], one[0], two[0]}) == 3
    _rewrite_keeping_mtime(ad1 / "model.safetensors", b"c" * 512)  # adapter retrained
    assert keys(SimpleNamespace(lora_path=str(ad1))) not in (one, two)
    with pytest.raises(Bypass, match="lora"):  # files gone: bypass, never keyed by name
        keys(SimpleNamespace(lora_path=str(tmp_path / "gone")))
    with pytest.raises(Bypass, match="lora"):  # no resolver: bypass as before
        request_keys(_request(tokens, SimpleNamespace(lora_path=str(ad2))), namespace="ns",
                     chunk_tokens=64)


def test_a_dangling_link_or_an_unreadable_stray_file_does_not_stop_the_engine(
        tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    before = weights_digest(model, memo_dir=None).digest
    (model / "README.md").symlink_to(tmp_path / "nowhere")
    assert weights_digest(model, memo_dir=None).digest == before
