"""Helpers shared by the benchmark scripts in this folder (run as ``python scripts/X.py``,
which puts this folder on ``sys.path``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def engine_env() -> dict[str, str]:
    """The environment of a benchmark's engine child: vLLM in one process, block hashes
    stable across processes (a restart must find what the last one stored), quiet logs."""
    return dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONHASHSEED="0",
                VLLM_LOGGING_LEVEL="ERROR", TOKENIZERS_PARALLELISM="false")


def spawn_phase(script: Path, job: dict, workdir: Path, name: str) -> dict:
    """Run ``script --phase-job JOB --phase-out OUT`` for ``job`` in a fresh interpreter
    (a restart) and return the JSON it wrote; exits naming ``name`` and the child's stderr
    tail if it failed."""
    job_path, out_path = workdir / f"{name}.job.json", workdir / f"{name}.out.json"
    job_path.write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, str(script), "--phase-job", str(job_path),
                           "--phase-out", str(out_path)], env=engine_env(),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"phase {name} failed:\n{proc.stderr[-4000:]}")
    return json.loads(out_path.read_text())


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the page cache and the kernel's directory caches, so
    the next read comes from the disk. False where that is not allowed (not root, a
    container): the caller must then report its reads as possibly warm."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def equal_work_ratio(ours_s: float, ours_work: int | list[int], peer_s: float,
                     peer_work: int | list[int]) -> tuple[float | None, str | None]:
    """``ours_s / peer_s`` only where both sides did the same work (tokens restored, blocks
    stored: one count or one per repeat, paired); otherwise ``(None, why)``. A side that
    did less work is faster for it, so its time compares to nothing."""
    ours = ours_work if isinstance(ours_work, list) else [ours_work]
    peer = peer_work if isinstance(peer_work, list) else [peer_work]
    if len(ours) != len(peer):
        return None, f"{len(ours)} measured runs against {len(peer)}"
    for i, (a, b) in enumerate(zip(ours, peer, strict=True)):
        if a != b:
            side = "the peer" if b < a else "ours"
            return None, f"run {i}: ours did {a}, the peer {b} ({side} did less)"
    if peer_s <= 0:
        return None, "the peer's time is not positive"
    return round(ours_s / peer_s, 4), None
