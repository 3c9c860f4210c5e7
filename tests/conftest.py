"""Shared fixtures: real stores in temp dirs, and the locally generated tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable
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


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a ChatML chat template (``tiny-chat`` preset), built once."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from spoolctl.tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-chat", "tiny-chat")


@pytest.fixture
def mount_tmpfs(tmp_path: Path):
    """Mount size-limited tmpfs filesystems for this test: ``mount_tmpfs("4m") -> Path``.

    Needs root; the test is skipped with the reason where mounting is refused.
    """
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        mnt = Path(os.path.realpath(tmp_path)) / f"fs-{uuid.uuid4().hex[:6]}"
        mnt.mkdir()
        if os.geteuid() != 0:
            pytest.skip("mounting a size-limited tmpfs needs root")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                               str(mnt)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    mount_fn: Callable[[str], Path] = mount
    yield mount_fn
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
