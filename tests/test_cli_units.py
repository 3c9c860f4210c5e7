"""In-process CLI tests (typer's CliRunner) and pure rendering helpers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spoolctl.cli import render
from spoolctl.cli.app import app
from spoolctl.cli.scrub_cmds import parse_rate_option
from spoolctl.cli.vllm_config import kv_transfer_config
from spoolctl.controllers.genai_records import expires_in
from spoolctl.store import ConfigError, Store

runner = CliRunner()


def test_rel_time_and_expiry() -> None:
    now = 1_000_000.0
    assert render.rel_time(now - 30, now) == "30s ago"
    assert render.rel_time(now - 7200, now) == "2h ago"
    assert render.rel_time(now + 3 * 86400 + 5, now) == "in 3d"
    assert render.rel_time(None) == "never"
    assert expires_in({"expire_time": now + 90}, now) == 90
    assert expires_in({"expire_time": "soon"}, now) is None
    assert expires_in({}, now) is None
    assert render.expiry_text(-1) == "expired"


def test_rate_option() -> None:
    assert parse_rate_option("64MiB/s") == 64 << 20
    assert parse_rate_option("0") is None and parse_rate_option("unlimited") is None
    with pytest.raises(ConfigError):
        parse_rate_option("quick")


def test_kv_transfer_config_shape() -> None:
    doc = kv_transfer_config("/nvme/spool", None)
    assert doc["kv_connector_extra_config"] == {"spoolctl_root": "/nvme/spool"}
    assert doc["kv_role"] == "kv_both"


def _store_with_released(root: Path) -> list[str]:
    with Store.open(root, create=True) as store:
        ids = [store.put(kind="mlx", namespace="m", key=f"k{i}",
                         objects={"kv": bytes([i]) * 500}).entry_id for i in range(3)]
        store.release(ids[0])
    return ids


def test_interactive_clean_asks_and_respects_no(store_root: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    ids = _store_with_released(store_root)
    monkeypatch.setattr(render, "stdin_is_tty", lambda: True)
    declined = runner.invoke(app, ["clean", "--root", str(store_root), "--released"],
                             input="n\n")
    assert declined.exit_code == 0 and "would delete" in declined.output
    with Store.open(store_root) as store:
        assert store.row(ids[0]) is not None
    accepted = runner.invoke(app, ["clean", "--root", str(store_root), "--released"],
                             input="y\n")
    assert accepted.exit_code == 0 and "deleted" in accepted.output
    with Store.open(store_root) as store:
        assert store.row(ids[0]) is None and store.row(ids[1]) is not None


def test_status_json_in_process(store_root: Path) -> None:
    _store_with_released(store_root)
    result = runner.invoke(app, ["status", "--root", str(store_root), "--json"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["by_kind"] == {"mlx": {"entries": 3, "bytes": doc["bytes"], "released": 1}}
    assert doc["scrub"] == {"last_cycle": None, "current": None, "last_findings": []}
    assert doc["released"]["entries"] == 1 and doc["max_bytes"] is None
    with Store.open(store_root) as store:
        assert time.time() - 60 < store.marker.created <= time.time()
