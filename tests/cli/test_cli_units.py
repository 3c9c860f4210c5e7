"""In-process CLI tests (typer's CliRunner) and pure rendering helpers."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from testpaths import TESTS_DIR
from typer.testing import CliRunner

from spoolctl.cli import render
from spoolctl.cli.app import app
from spoolctl.cli.scrub_cmds import parse_rate_option
from spoolctl.cli.vllm_config import kv_transfer_config
from spoolctl.controllers.genai.records import expires_in
from spoolctl.store import ConfigError, Store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

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


def test_root_resolves_to_one_store_or_the_rank_stores_of_a_deployment(tmp_path: Path) -> None:
    from spoolctl.cli.targets import resolve_targets

    base = Path(os.path.realpath(tmp_path))
    single = resolve_targets(base / "store")  # not there yet: one store (open says why)
    assert single.kind == "store" and [t.root for t in single.stores] == [base / "store"]
    dep = base / "deployment"
    for rank in (1, 0):
        Store.open(dep / f"rank-{rank:04d}", create=True).close()
    (dep / "rank-0002").symlink_to(dep / "rank-0000")  # never followed
    (dep / "notes").mkdir()
    targets = resolve_targets(dep)
    assert targets.kind == "deployment"
    assert [(t.rank, t.root.name) for t in targets.stores] == [(0, "rank-0000"),
                                                                (1, "rank-0001")]
    inner = resolve_targets(dep / "rank-0000")  # a rank store is a store
    assert inner.kind == "store" and inner.stores[0].rank is None


def test_deployment_status_folds_rank_reports() -> None:
    from spoolctl.connector.deployment.topology import RankReport, deployment_status

    def report(rank: int, keys: set[str], quarantined: int = 0) -> RankReport:
        return RankReport(rank=rank, root=f"/r/rank-{rank:04d}", entries=len(keys), bytes=10,
                          max_bytes=None, quarantined=quarantined, chunk_keys=frozenset(keys))

    ok = deployment_status("/r", [report(1, {"a", "b"}), report(0, {"a", "b"})])
    assert ok.agree and not ok.has_findings
    doc = ok.to_json()
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and doc["complete_chunks"] == 2
    gap = deployment_status("/r", [report(0, {"a"}), report(2, {"a", "b"})])
    assert gap.to_json()["missing_ranks"] == [1] and gap.has_findings
    assert gap.to_json()["ranks"][0]["missing_chunks"] == 1
    assert deployment_status("/r", [report(0, {"a"}, quarantined=1)]).has_findings


def test_genai_expiry_summary() -> None:
    from spoolctl.controllers.genai.records import expiry_summary
    from spoolctl.store import CatalogRow

    def row(index: dict) -> CatalogRow:
        return CatalogRow("0" * 64, "genai", "ns", "k", 0, 0, 0.0, 0.0, "retain",
                          "committed", None, index)

    now = 1_000.0
    rows = [row({"expire_time": now - 5}), row({"expire_time": now + 50}),
            row({"expire_time": now + 20}), row({"expire_time": "soon"})]
    # "soon" is not a time: counted as malformed, never as expired or next.
    assert expiry_summary(rows, now).to_json() == {"entries": 4, "expired": 1,
                                                   "next_expiry_in_s": 20.0, "malformed": 1}
    assert expiry_summary([], now).to_json() == {"entries": 0, "expired": 0,
                                                 "next_expiry_in_s": None, "malformed": 0}



def test_in_process_commands_take_columns_at_each_command(store_root: Path) -> None:
    """Each in-process command renders at the COLUMNS it is run with, not at the width the
    process had when the CLI was imported (the console was made once, at import, so a
    test's table width depended on whichever test imported it first). A fresh interpreter
    imports the CLI at 120 columns, then runs `status` at 50 (a long root wraps inside 50)
    and at 200 (it stays on one line)."""
    import subprocess
    import sys

    long_root = store_root.parent / ("a-long-store-directory-name-" * 3)
    Store.open(long_root, create=True).close()
    script = f"""
import json, sys
sys.path.insert(0, {str(TESTS_DIR)!r})
import spoolctl.cli.app
from operator_cli import run
print(json.dumps([run("status", "--root", {str(long_root)!r}, env={{"COLUMNS": width}})
                  for width in ("50", "200")]))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLCTL_")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**env, "COLUMNS": "120"})
    assert proc.returncode == 0, proc.stderr
    (code, narrow, _), (code2, wide, _) = json.loads(proc.stdout)
    assert code == 0 and max(len(line) for line in narrow.splitlines()) <= 50, narrow
    assert code2 == 0 and str(long_root) in wide, wide
