"""vLLM's attention backends and the KV specs they make, resolved in a child process.

Resolving every ``AttentionBackendEnum`` member imports backend modules written for CUDA, ROCm and
XPU; one of them imports ``vllm.platforms.rocm`` and with it ``vllm._C``, which aborts an
interpreter that already loaded another CPU class's kernel library. So the test process never
resolves them: a child does, under the same platform guard as the test session
(``tests/platform_guard.py``), and answers in JSON: per member, the customised spec (pickled),
the kernel block size and the layouts it declares, or why it is not usable. The answer is the
same on every CPU class, and is remembered per vLLM install and class.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
TIMEOUT_S = 600

_CHILD = r"""
import base64, json, pickle, sys
sys.path.insert(0, sys.argv[1])
import platform_guard
guard = platform_guard.guard_this_process()
import torch
import vllm._custom_ops  # noqa: F401  the kernel library this host's platform chooses
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.v1.worker.utils import customize_attention_spec, select_common_block_size

for member in AttentionBackendEnum:
    mark = len(guard.refused)
    try:
        cls = member.get_class()
        mla = "MLA" in member.name
        spec = (MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576,
                                 dtype=torch.bfloat16, cache_dtype_str="auto") if mla
                else FullAttentionSpec(block_size=64, num_kv_heads=4, head_size=64,
                                       dtype=torch.bfloat16))
        spec = customize_attention_spec(cls, spec)
        kernel = select_common_block_size(spec.block_size, [cls], [spec])
        layouts = [layout.name for layout in get_supported_kv_cache_layouts([cls])]
        doc = {"name": member.name, "kernel": int(kernel), "layouts": layouts,
               "spec": base64.b64encode(pickle.dumps(spec)).decode()}
    except Exception as exc:
        refused = guard.since(mark)
        why = (f"resolving it imports {refused[0].module}: {refused[0].why}" if refused
               else f"{type(exc).__name__}: {exc}")
        doc = {"name": member.name, "unusable": why}
    print(json.dumps(doc), flush=True)
"""


@dataclass(frozen=True)
class Backend:
    """One member of ``AttentionBackendEnum`` as this vLLM build resolves it."""

    name: str
    spec: str | None = None  # the spec object, pickled by the child (our own process)
    kernel: int | None = None
    layouts: tuple[str, ...] = ()
    unusable: str | None = None

    def make_spec(self) -> Any:
        """The customised spec (a vLLM dataclass), rebuilt in this process."""
        assert self.spec is not None, self
        return pickle.loads(base64.b64decode(self.spec))


def _cache_file() -> Path:
    return Path(sys.prefix) / ".spoolctl-vllm-backends.json"


def _cache_key() -> str:
    import importlib.util

    import platform_guard
    spec = importlib.util.find_spec("vllm")
    origin = Path(spec.origin) if spec and spec.origin else Path("/")
    registry = origin.parent / "v1" / "attention" / "backends" / "registry.py"
    stamp = [str(p.stat().st_mtime_ns) for p in (origin, registry) if p.exists()]
    return hashlib.sha256("\0".join([platform_guard.cpu_class(), str(origin), *stamp,
                                     _CHILD]).encode()).hexdigest()


def resolve() -> list[Backend]:
    """Every backend member, resolved in a child process (remembered per vLLM install)."""
    key = _cache_key()
    try:
        doc = json.loads(_cache_file().read_text())
        if doc.get("key") == key:
            return [Backend(**{**b, "layouts": tuple(b.get("layouts", ()))})
                    for b in doc["backends"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(TESTS)], capture_output=True,
                          text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0:
        last = lines[-1]["name"] if lines else "(before the first member)"
        raise RuntimeError(f"resolving vLLM's attention backends in a child process failed "
                           f"(exit {proc.returncode}) after {last}: {proc.stderr[-2000:]}")
    backends = [Backend(**{**b, "layouts": tuple(b.get("layouts", ()))}) for b in lines]
    try:
        tmp = _cache_file().with_name(f"{_cache_file().name}.{os.getpid()}.part")
        tmp.write_text(json.dumps({"key": key, "backends": [dataclasses.asdict(b)
                                                             for b in backends]}))
        os.replace(tmp, _cache_file())
    except OSError:
        pass  # a read-only prefix: resolve again next session
    return backends
