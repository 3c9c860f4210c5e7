"""A hub model served at another revision is another namespace for SpoolTier: its weights
digest is that of the snapshot the engine loaded, not of the default branch's."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

constants = pytest.importorskip("huggingface_hub.constants")

from spoolctl.connector.tier.identity import weights_of  # noqa: E402
from spoolctl.connector.tier.settings import parse_settings  # noqa: E402
from spoolctl.errors import ConfigError  # noqa: E402


def hub_revision(cache: Path, ref: str, commit: str, weights: bytes) -> None:
    """One revision of ``org/tiny`` in a Hugging Face hub cache: a ref, a snapshot, blobs."""
    repo = cache / "models--org--tiny"
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snap.mkdir(parents=True)
    (repo / "refs" / ref).write_text(commit)
    for name, data in {"config.json": b"{}", "model.safetensors": weights}.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))


def test_each_revision_of_a_hub_model_is_its_own_weights(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    settings = parse_settings({"root": "/r", "weights_memo": "off"})
    hub_revision(tmp_path / "hub", "v2", "b" * 40, b"v" * 99)
    with pytest.raises(ConfigError, match="weights_id"):
        weights_of("org/tiny", settings, None)  # no default branch cached
    v2 = weights_of("org/tiny", settings, "v2")
    hub_revision(tmp_path / "hub", "main", "a" * 40, b"w" * 99)
    main = weights_of("org/tiny", settings, None)
    assert len({main, v2, weights_of("org/tiny", settings, "b" * 40)}) == 2
    assert weights_of("org/tiny", settings, "main") == main != v2
