"""SpoolTier's start-up checks as an operator meets them (no vLLM): a root it cannot use
and a bound too small for one chunk are each one ConfigError line naming the option and the
fix; the store is not created or rewritten by a refused start."""

from __future__ import annotations

from pathlib import Path

import pytest

from spoolctl.connector.tier.settings import check_room, parse_settings
from spoolctl.connector.tier.startup import open_store
from spoolctl.errors import ConfigError
from spoolctl.store import Store

pytestmark = pytest.mark.base

CHUNK = 1 << 20


def one_line(exc: pytest.ExceptionInfo[ConfigError]) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_a_root_on_a_read_only_disk_is_one_line_naming_root(mount_tmpfs) -> None:
    read_only_dir = mount_tmpfs("1m", read_only=True)
    for root in (read_only_dir, read_only_dir / "store"):
        with pytest.raises(ConfigError) as exc:
            open_store(parse_settings({"root": str(root)}), CHUNK)
        line = one_line(exc)
        assert "read-only filesystem" in line and "SpoolTier option 'root'" in line
        assert str(root) in line


def test_a_root_under_a_file_is_one_line_naming_root(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    for root in (tmp_path / "afile", tmp_path / "afile" / "store"):
        with pytest.raises(ConfigError) as exc:
            open_store(parse_settings({"root": str(root)}), CHUNK)
        assert "not a directory" in one_line(exc)


def test_a_max_size_below_two_chunks_is_refused_before_the_store_is_made(
        tmp_path: Path) -> None:
    root = tmp_path / "store"
    with pytest.raises(ConfigError) as exc:
        open_store(parse_settings({"root": str(root), "max_size": "1MiB"}), CHUNK)
    line = one_line(exc)
    assert "'max_size'" in line and "nothing would ever be stored" in line and "GiB" in line
    assert not root.exists()
    check_room(2 * CHUNK, CHUNK)
    check_room(None, CHUNK)


def test_a_store_recorded_too_small_for_this_engine_is_refused_and_kept(
        tmp_path: Path) -> None:
    root = tmp_path / "store"
    Store.open(root, create=True, max_bytes=CHUNK).close()
    with pytest.raises(ConfigError) as exc:
        open_store(parse_settings({"root": str(root)}), CHUNK)
    assert "recorded max size" in one_line(exc)
    with Store.open(root) as store:
        assert store.max_bytes == CHUNK
    with open_store(parse_settings({"root": str(root), "max_size": "1GiB"}), CHUNK) as store:
        assert store.max_bytes == 1 << 30


def test_a_relative_weights_memo_is_refused() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_settings({"root": "/r", "weights_memo": "memo"})
    assert "'weights_memo'" in one_line(exc)
    assert parse_settings({"root": "/r", "weights_memo": "off"}).weights_memo == "off"


def test_a_spoolconnector_root_is_refused_naming_root(tmp_path: Path) -> None:
    """The SpoolConnector keeps rank stores under its root; the tier's root is one store."""
    root = tmp_path / "connector"
    Store.open(root / "vllm-v1-abc" / "rank-0000", create=True).close()
    with pytest.raises(ConfigError) as exc:
        open_store(parse_settings({"root": str(root)}), CHUNK)
    line = one_line(exc)
    assert line.startswith("SpoolTier option 'root': ") and "without a .spoolctl-root" in line
    assert 'set "root" to a new or empty directory' in line
    assert [p.name for p in root.iterdir()] == ["vllm-v1-abc"]
