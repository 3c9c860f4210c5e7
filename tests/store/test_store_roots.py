"""Store roots are safe: every refusal case, modes, marker handling."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from spoolctl.store import RootError, Store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)


def test_create_sets_layout_marker_and_private_modes(store_root: Path) -> None:
    with Store.open(store_root, create=True, max_bytes=1 << 30) as store:
        store.put(kind="mlx", namespace="ns", key="k", objects={"a": b"payload"})
    marker = json.loads((store_root / ".spoolctl-root").read_text())
    # every store this version writes keeps its hints in state/hints.log (decision 3050)
    assert marker["schema"] == "spoolctl-root/v2" and marker["requires"] == ["hints-log"]
    assert marker["max_bytes"] == 1 << 30
    for name in ("objects", "manifests", "tmp", "quarantine", "state"):
        assert stat.S_IMODE(os.stat(store_root / name).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store_root).st_mode) == 0o700
    files = [p for p in store_root.rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    files = [p for p in files if "catalog.sqlite3" not in p.name]
    assert files, "expected marker, manifest and object files"
    for path in files:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path


def test_reopen_keeps_entries_and_updates_max_bytes(store_root: Path) -> None:
    with Store.open(store_root, create=True) as store:
        store.put(kind="mlx", namespace="ns", key="k", objects={"a": b"x"})
    with Store.open(store_root, max_bytes=123456) as store:
        assert store.lookup("mlx", "ns", "k") is not None
        assert store.max_bytes == 123456


def test_refuses_relative_root() -> None:
    with pytest.raises(RootError, match="absolute") as info:
        Store.open("relative/store", create=True)
    assert "--root" in str(info.value)


def test_refuses_symlinked_root(tmp_path: Path) -> None:
    real = Path(os.path.realpath(tmp_path))
    (real / "target").mkdir()
    (real / "link").symlink_to(real / "target")
    with pytest.raises(RootError, match="symlink") as info:
        Store.open(real / "link", create=True)
    assert str(real / "link") in str(info.value)
    assert not (real / "target" / ".spoolctl-root").exists()


def test_refuses_symlinked_ancestor(tmp_path: Path) -> None:
    real = Path(os.path.realpath(tmp_path))
    (real / "target").mkdir()
    (real / "link").symlink_to(real / "target")
    with pytest.raises(RootError, match="symlink"):
        Store.open(real / "link" / "store", create=True)
    assert not (real / "target" / "store").exists()


def test_refuses_non_empty_directory_without_marker(store_root: Path) -> None:
    store_root.mkdir()
    (store_root / "precious.txt").write_text("user data")
    with pytest.raises(RootError, match="non-empty") as info:
        Store.open(store_root, create=True)
    assert str(store_root) in str(info.value)
    assert sorted(os.listdir(store_root)) == ["precious.txt"]


def test_refuses_foreign_marker_schema(store_root: Path) -> None:
    store_root.mkdir()
    (store_root / ".spoolctl-root").write_text(json.dumps({"schema": "other-tool/v9"}))
    with pytest.raises(RootError, match="other-tool/v9"):
        Store.open(store_root, create=True)


def test_refuses_unmarked_root_without_create(store_root: Path) -> None:
    with pytest.raises(RootError, match="does not exist"):
        Store.open(store_root)
    store_root.mkdir()
    with pytest.raises(RootError, match="spoolctl init"):
        Store.open(store_root)


def test_refuses_a_file_as_root(store_root: Path) -> None:
    store_root.write_text("not a dir")
    with pytest.raises(RootError, match="not a directory"):
        Store.open(store_root, create=True)


def test_empty_existing_directory_is_adopted(store_root: Path) -> None:
    store_root.mkdir()
    with Store.open(store_root, create=True) as store:
        assert store.totals().entries == 0
    assert (store_root / ".spoolctl-root").exists()


def test_unknown_top_level_files_are_reported_not_deleted(store_root: Path) -> None:
    Store.open(store_root, create=True).close()
    (store_root / "stray.bin").write_bytes(b"??")
    with Store.open(store_root) as store:
        assert store.unknown_files == ["stray.bin"]
    assert (store_root / "stray.bin").exists()


def test_import_store_pulls_no_framework() -> None:
    code = (
        "import sys, spoolctl, spoolctl.store, spoolctl.controllers.contract, spoolctl.cli.app\n"
        "bad = [m for m in ('torch', 'vllm', 'mlx', 'google.genai', 'transformers')"
        " if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_refuses_a_root_owned_by_another_user(store_root: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("changing a directory's owner needs root")
    Store.open(store_root, create=True).close()
    os.chown(store_root, 65534, 65534)
    with pytest.raises(RootError, match="owned by uid 65534") as info:
        Store.open(store_root)
    assert "--allow-foreign-owner" in str(info.value)
    with Store.open(store_root, allow_foreign_owner=True) as store:
        assert store.totals().entries == 0


@pytest.mark.parametrize("sub", ["objects/ab", "manifests/00", "tmp", "state"])
def test_symlink_swapped_in_for_a_store_directory_is_refused(store_root: Path, tmp_path, sub):
    Store.open(store_root, create=True).close()
    elsewhere = Path(os.path.realpath(tmp_path)) / "elsewhere"
    elsewhere.mkdir()
    victim = store_root / sub
    shutil.rmtree(victim)
    victim.symlink_to(elsewhere)
    with pytest.raises(RootError, match=r"symlink|directory"):
        Store.open(store_root)
    assert list(elsewhere.iterdir()) == []
