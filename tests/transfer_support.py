"""Helpers for the export/import tests: the real console script, stores with content,
and snapshots that compare two stores entry by entry (manifest bytes and verified payloads)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from operator_cli import ENV, SPOOLCTL, script  # noqa: F401 - ENV, SPOOLCTL used by importers

from spoolctl.store import Store


def cli(*args: str, stdin: bytes | None = None, env: dict | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the installed ``spoolctl`` (bytes in, bytes out)."""
    return script(*args, stdin=stdin, env=env, timeout=timeout, text=False)


def cli_json(*args: str, expect: int = 0, stdin: bytes | None = None) -> dict:
    proc = cli(*args, "--json", stdin=stdin)
    assert proc.returncode == expect, proc.stderr.decode()
    return json.loads(proc.stdout)


def payload(key: str, size: int) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def fill(root: Path, n: int, *, size: int = 5000, kind: str = "pytorch",
         namespace: str = "model-x", prefix: str = "k", shared: bool = True) -> list[str]:
    """``n`` entries (each with its own object and, if ``shared``, one object common to all)."""
    ids = []
    with Store.open(root, create=True) as store:
        for i in range(n):
            objects = {"kv": payload(f"{prefix}{i}", size + i)}
            if shared:
                objects["common"] = payload("common", 777)
            m = store.put(kind=kind, namespace=namespace, key=f"{prefix}{i}", objects=objects,
                          meta={"i": i, "text": "[bold]markup[/bold]"}, index={"n": i})
            ids.append(m.entry_id)
    return ids


def snapshot(root: Path) -> dict[str, tuple[bytes, dict[str, bytes], str]]:
    """Per live entry: manifest file bytes, verified payloads, catalog facts."""
    out = {}
    with Store.open(root) as store:
        for row in store.entries():
            m = store.manifest(row.entry_id)
            raw = store.layout.manifest_path(row.entry_id).read_bytes()
            out[row.entry_id] = (raw, {k: bytes(v) for k, v in store.read_all(m).items()},
                                 f"{row.kind}|{row.namespace}|{row.key}|{row.hint}|"
                                 f"{json.dumps(row.index, sort_keys=True)}")
    return out


def files_under(path: Path) -> dict[str, tuple[int, int]]:
    """Every file below ``path``: size and mtime (to prove a source was only read)."""
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file() or p.is_symlink():
            st = p.lstat()
            out[str(p.relative_to(path))] = (st.st_size, st.st_mtime_ns)
    return out


def tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("tmp/*")]
