"""The connector's start-up checks (issue 36 item 9): a root the engine cannot write, a max
size below one chunk and a root on tmpfs are said in one line at the connector's first hook
and by ``spoolctl config vllm``, not after the engine started, inside a vLLM traceback.

vLLM's real ``ModelConfig`` of the tiny Llama gives the chunk size; no engine is started.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from spoolctl.errors import ConfigError
from tests.operator_cli import run

pytest.importorskip("vllm")

from vllm.config import CacheConfig, ModelConfig, ParallelConfig

from spoolctl.connector.deployment.preflight import chunk_bytes_estimate, preflight

# The tiny Llama: 2 layers x 2 KV heads x head size 32 x K and V x float32, 256-token chunks.
TINY_CHUNK_BYTES = 256 * 2 * 2 * 32 * 2 * 4


@pytest.fixture(scope="module")
def model_config(tiny_model_dir: Path) -> ModelConfig:
    return ModelConfig(model=str(tiny_model_dir), dtype="float32")


def vllm_config(model_config: ModelConfig, root: Path | str, **extra: str) -> SimpleNamespace:
    """vLLM's config objects as the connector's first hook gets them (real model, cache and
    parallel configs; the transfer config's connector options)."""
    return SimpleNamespace(
        model_config=model_config, cache_config=CacheConfig(block_size=128),
        parallel_config=ParallelConfig(),
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"spoolctl_root": str(root), **extra}))


@pytest.fixture
def readonly_dir(mount_tmpfs) -> Path:
    """A directory on a read-only mount (root can write any mode bits, not a ro mount)."""
    mnt = mount_tmpfs("1m")
    proc = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot remount read-only here: {proc.stderr.strip()}")
    return mnt


def test_chunk_estimate_is_the_models_chunk(model_config: ModelConfig) -> None:
    cfg = vllm_config(model_config, "/x")
    assert chunk_bytes_estimate(cfg, 256) == TINY_CHUNK_BYTES


def test_max_size_below_one_chunk_refused_at_the_first_hook(model_config, tmp_path) -> None:
    cfg = vllm_config(model_config, os.path.realpath(tmp_path), spoolctl_max_size="64KiB")
    with pytest.raises(ConfigError) as err:
        preflight(cfg)
    line = str(err.value)
    assert "spoolctl_max_size 64.0 KiB is smaller than one 256-token chunk" in line
    assert "(256.0 KiB per rank)" in line and "\n" not in line
    # one chunk fits: starts
    assert preflight(vllm_config(model_config, os.path.realpath(tmp_path),
                                 spoolctl_max_size="256KiB")) == []


def test_unwritable_root_refused_at_the_first_hook(model_config, readonly_dir) -> None:
    root = readonly_dir / "spool"
    with pytest.raises(ConfigError) as err:
        preflight(vllm_config(model_config, root))
    assert "cannot create stores under" in str(err.value) and str(root) in str(err.value)
    # the connector's own hook (what vLLM calls before the KV cache is allocated)
    from spoolctl.connector import SpoolConnector

    with pytest.raises(ConfigError):
        SpoolConnector.get_required_kvcache_layout(vllm_config(model_config, root))


def test_tmpfs_root_is_a_warning(model_config, mount_tmpfs, caplog) -> None:
    root = mount_tmpfs("4m") / "spool"
    with caplog.at_level("WARNING", logger="spoolctl.connector"):
        warnings = preflight(vllm_config(model_config, root))
    assert len(warnings) == 1 and "on tmpfs" in warnings[0] and "RAM" in warnings[0]
    assert any("on tmpfs" in r.getMessage() for r in caplog.records)
    assert not root.exists()  # checking creates nothing


def test_config_vllm_checks_what_its_help_says(readonly_dir, mount_tmpfs) -> None:
    code, out, err = run("config", "vllm", "--root", str(readonly_dir / "spool"),
                         "--max-size", "1GiB")
    assert code == 2 and out == ""
    assert "cannot create stores under" in err and "read-only filesystem" in err
    assert len(err.strip().splitlines()) == 1
    code, out, err = run("config", "vllm", "--help")
    assert "you can create stores under it" in " ".join(out.split()) and "tmpfs" in out
    tmpfs_root = mount_tmpfs("4m") / "spool"
    code, out, err = run("config", "vllm", "--root", str(tmpfs_root), "--max-size", "1GiB")
    assert code == 0 and '"spoolctl_root"' in out
    assert err.startswith("warning: ") and "on tmpfs" in err


def test_doctor_warns_on_tmpfs(mount_tmpfs) -> None:
    from tests.operator_cli import run_json

    root = mount_tmpfs("4m") / "store"
    run_json("init", "--root", str(root), "--max-size", "1MiB")
    _, out, _ = run("doctor", "--root", str(root), "--json")
    doc = json.loads(out)
    fs = next(c for c in doc["checks"] if c["name"] == "fs.type")
    assert fs["status"] == "warn" and "tmpfs" in fs["detail"] and fs["fix"]


def test_config_vllm_checks_the_max_size_against_a_local_model(tiny_model_dir, tmp_path):
    """Before vLLM starts (examples/vllm_serve.sh passes --model): one line, exit 2."""
    from spoolctl.connector.deployment.preflight import chunk_bytes_from_model_dir

    assert chunk_bytes_from_model_dir(tiny_model_dir) == TINY_CHUNK_BYTES
    assert chunk_bytes_from_model_dir(tiny_model_dir, tp=2) == TINY_CHUNK_BYTES // 2
    root = str(Path(os.path.realpath(tmp_path)) / "spool")
    code, out, err = run("config", "vllm", "--root", root, "--max-size", "64KiB",
                         "--model", str(tiny_model_dir))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "smaller than one 256-token chunk" in err
    code, out, _ = run("config", "vllm", "--root", root, "--max-size", "1GiB",
                       "--model", str(tiny_model_dir))
    assert code == 0 and json.loads(out)["kv_connector_extra_config"]["spoolctl_max_size"] \
        == "1GiB"
    # a hub id (no local config.json): nothing to check here, the connector checks
    assert run("config", "vllm", "--root", root, "--max-size", "64KiB",
               "--model", "org/model")[0] == 0
