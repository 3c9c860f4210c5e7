"""``spoolctl prefill --backend mlx`` and the operator commands on mlx entries, run as the
installed console script (a real process) on a real store."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from operator_cli import script

try:
    import mlx.core  # noqa: F401
except ImportError as exc:  # pragma: no cover - only where mlx cannot be installed
    pytest.skip(f"mlx is not installed here ({exc}); pip install 'mlx-lm[cpu]'",
                allow_module_level=True)

from spoolctl.store import Store

PROMPT = "You are a helpful assistant. Answer from the spool store manual below."


def cli(*args: str) -> subprocess.CompletedProcess:
    return script(*args, timeout=300)


def prefill(model: Path, root: Path, *extra: str) -> dict:
    proc = cli("prefill", "--backend", "mlx", "--model", str(model), "--root", str(root),
               "--json", *extra)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_prefill_mlx_then_hit_scrub_and_corruption(tiny_model_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "store"
    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps([{"role": "system", "content": PROMPT},
                                    {"role": "user", "content": "Objects are named by digest."}]))
    first = prefill(tiny_model_dir, root, "--messages-file", str(messages))
    assert first["backend"] == "mlx" and first["source"] == "cold" and first["tokens"] > 0
    second = prefill(tiny_model_dir, root, "--messages-file", str(messages))
    assert second["source"] == "disk" and second["entry_id"] == first["entry_id"]
    assert second["tokens_written"] == 0

    listed = json.loads(cli("ls", "--root", str(root), "--kind", "mlx", "--json").stdout)
    assert [e["entry_id"] for e in listed["entries"]] == [first["entry_id"]]
    scrub = cli("scrub", "--root", str(root), "--json")
    assert scrub.returncode == 0 and json.loads(scrub.stdout)["quarantined"] == []

    with Store.open(root) as store:
        obj = store.layout.object_path(store.manifest(first["entry_id"]).object("kv").digest)
    data = bytearray(obj.read_bytes())
    data[-3] ^= 0x01
    obj.write_bytes(bytes(data))
    scrub = cli("scrub", "--root", str(root), "--json")
    assert scrub.returncode == 1, scrub.stdout  # findings: the corrupt mlx entry
    assert first["entry_id"] in json.dumps(json.loads(scrub.stdout)["quarantined"])
    again = prefill(tiny_model_dir, root, "--messages-file", str(messages))
    assert again["source"] == "cold" and again["entry_id"] == first["entry_id"]


def test_prefill_mlx_incremental_supersedes(tiny_model_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "store"
    base_doc = {"instructions": [PROMPT], "data": ["Objects are named by digest."]}
    grown_doc = {**base_doc, "data": [*base_doc["data"], "Manifests are written last."]}
    base_file, grown_file = tmp_path / "base.json", tmp_path / "grown.json"
    base_file.write_text(json.dumps(base_doc))
    grown_file.write_text(json.dumps(grown_doc))
    base = prefill(tiny_model_dir, root, "--messages-file", str(base_file))
    grown = prefill(tiny_model_dir, root, "--messages-file", str(grown_file))
    assert grown["source"] == "incremental" and grown["supersedes"] == base["entry_id"]
    assert grown["tokens_reused"] == base["tokens"]
    assert grown["tokens_written"] == grown["tokens"] - base["tokens"] > 0


def test_prefill_mlx_bad_model_is_one_clear_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty-model"
    empty.mkdir()
    proc = cli("prefill", "--backend", "mlx", "--model", str(empty), "--prompt", "hi",
               "--root", str(tmp_path / "store"))
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    assert str(empty) in proc.stderr
