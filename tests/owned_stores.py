"""Stores owned by the unprivileged test user (``tests/unprivileged.py``), for tests in which
root runs spoolctl on a store another account owns and may tamper with."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from unprivileged import unprivileged_uid

from spoolctl.store import Store


def give(path: Path) -> None:
    """Make the unprivileged user own ``path`` and everything under it (as root; otherwise
    the files already belong to the user the work runs as)."""
    if os.geteuid() == 0:
        uid = unprivileged_uid()
        for p in [path, *path.rglob("*")]:
            os.lchown(p, uid, uid)


def owned_store(base: Path, n: int, released: int = 0) -> tuple[Path, list]:
    """A store at ``base/store`` with ``n`` entries (the first ``released`` of them released),
    given to the unprivileged user; returns the root and the manifests."""
    root = base / "store"
    with Store.open(root, create=True) as store:
        made = [store.put(kind="pytorch", namespace="ns", key=f"k{i}",
                          objects={"kv": os.urandom(4000)}) for i in range(n)]
        for m in made[:released]:
            store.release(m.entry_id)
    give(root)
    return root, made


def shared_dir(prefix: str) -> Iterator[Path]:
    """A new directory under /tmp that the unprivileged user can reach (pytest's tmp_path is
    root-only), removed afterwards: ``yield from shared_dir("spool-x-")`` in a fixture."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)
