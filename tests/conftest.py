"""Shared fixtures: real stores in temp dirs, and the locally generated tiny model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


@pytest.fixture
def store_root(tmp_path: Path) -> Path:
    """An absolute, symlink-free path for a new store (pytest's tmp_path is real)."""
    return Path(os.path.realpath(tmp_path)) / "store"


@pytest.fixture
def store(store_root: Path):
    from spoolctl.store import Store

    with Store.open(store_root, create=True) as s:
        yield s


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama, built once per test session (needs the torch extra)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from spoolctl.tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")
