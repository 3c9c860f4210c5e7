"""Security review, as tests: what the controllers and the store write to default logs and
metric labels (no prompt text, token ids or entry ids), the modes of every file a controller
writes (0700/0600 even under umask 0), no unpickling on a restore from disk (checked at run
time, not only statically), and ``spoolctl`` refusing a root owned by another user unless
``--allow-foreign-owner``."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from operator_cli import script

from spoolctl.store import CorruptionError, Store

SECRET = "Zanzibar-7731 launch code"
SYSTEM = f"You guard the vault. The secret is {SECRET}."
DOC = "The vault opens only at dawn and closes at dusk. " * 3
QUESTION = "When does the vault open?"


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path):
    pytest.importorskip("transformers")
    from spoolctl.controllers.pytorch import PyTorchBackend

    return PyTorchBackend(tiny_model_dir)


def _params():
    from spoolctl.controllers import CachePrepareParams

    return CachePrepareParams(instructions=[SYSTEM], data=[DOC])


def _hex_fragments(value: str, width: int = 8) -> set[str]:
    return {value[i:i + width] for i in range(0, len(value) - width + 1)}


def _flip(path: Path, offset: int = 40) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x04
    path.write_bytes(bytes(raw))


def test_default_logs_carry_no_prompt_tokens_or_ids(backend, store_root: Path, caplog) -> None:
    """A full life cycle with every warning path a corrupt store triggers: commit, corrupt
    object restore, corrupt manifest, hostile payload, release, close, CLI scrub."""
    from spoolctl.cli.app import main
    from spoolctl.controllers.pytorch import PyTorchCacheController

    caplog.set_level(logging.INFO)  # default is WARNING; INFO is stricter
    params = _params()
    secrets: set[str] = {SECRET, "Zanzibar", DOC.strip()[:30]}
    with PyTorchCacheController(backend, str(store_root)) as ctl:
        handle = ctl.prepare(params)
    with Store.open(store_root) as store:
        manifest = store.manifest(handle.ref)
        tokens = list(manifest.meta.get("tokens", [])) or \
            [t for seg in backend.tokenize_segments([SYSTEM]) for t in seg]
        ids = {handle.ref, *(ref.digest for ref in manifest.objects)}
        _flip(store.layout.object_path(manifest.objects[0].digest))
    with PyTorchCacheController(backend, str(store_root)) as ctl:  # corrupt object
        assert ctl.prepare(params).source == "cold"
        handle = ctl.prepare(params)
        ctl.release(handle.ref)
    with PyTorchCacheController(backend, str(store_root)) as ctl:
        handle = ctl.prepare(params)
    with Store.open(store_root) as store:
        manifest = store.manifest(handle.ref)
        ids |= {ref.digest for ref in manifest.objects}
        path = store.layout.manifest_path(handle.ref)
        path.write_bytes(path.read_bytes()[:-3])  # corrupt manifest
    with PyTorchCacheController(backend, str(store_root)) as ctl:
        assert ctl.prepare(params).source == "cold"
    with Store.open(store_root) as store:
        ids |= {ref.digest for row in store.entries()
                for ref in store.manifest(row.entry_id).objects}
        for row in store.entries():
            _flip(store.layout.object_path(store.manifest(row.entry_id).objects[0].digest))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            pytest.raises(SystemExit) as scrubbed:
        main(["scrub", "--root", str(store_root), "--until-complete", "--rate", "0"])
    assert scrubbed.value.code == 1  # findings: the flipped objects were found
    text = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    assert "quarantined" in text and "treated as a miss" in text  # the paths were exercised
    for s in secrets:
        assert s not in text
    for entry in ids:
        for frag in _hex_fragments(entry):
            assert frag not in text, f"an id fragment {frag} reached a default log"
    runs = {", ".join(map(str, tokens[i:i + 3])) for i in range(len(tokens) - 2)} | \
        {" ".join(map(str, tokens[i:i + 3])) for i in range(len(tokens) - 2)}
    assert not any(run in text for run in runs), "token ids reached a default log"


def test_metric_labels_are_a_closed_vocabulary(backend, store_root: Path) -> None:
    from spoolctl.controllers.pytorch import PyTorchCacheController
    from spoolctl.metrics import LABEL_VALUES, collect_store_gauges, render_samples

    with PyTorchCacheController(backend, str(store_root)) as ctl:
        handle = ctl.prepare(_params())
    with Store.open(store_root) as store:
        _flip(store.layout.object_path(store.manifest(handle.ref).objects[0].digest))
        with pytest.raises(CorruptionError):  # the read finds the flip and quarantines
            store.read_all(store.manifest(handle.ref))
        assert store.quarantine_items()
        exposition = render_samples(collect_store_gauges(store))
    labels = re.findall(r'(\w+)="([^"]*)"', exposition)
    assert labels
    for name, value in labels:
        assert value in LABEL_VALUES[name], (name, value)
    assert handle.ref[:8] not in exposition and SECRET not in exposition


def test_everything_a_controller_writes_is_private(backend, store_root: Path) -> None:
    from spoolctl.controllers.pytorch import PyTorchCacheController

    old = os.umask(0)  # a permissive umask must not leak into modes
    try:
        with PyTorchCacheController(backend, str(store_root)) as ctl:
            first = ctl.prepare(_params())
            ctl.release(first.ref)
            ctl.prepare(_params())
        with Store.open(store_root) as store:  # and quarantine evidence
            m = store.manifest(store.entries()[0].entry_id)
            _flip(store.layout.object_path(m.objects[0].digest))
            with pytest.raises(CorruptionError):
                store.read_all(m)
            assert store.quarantine_items()
    finally:
        os.umask(old)
    seen = 0
    for path in [store_root, *store_root.rglob("*")]:
        mode = stat.S_IMODE(os.lstat(path).st_mode)
        assert not stat.S_ISLNK(os.lstat(path).st_mode), path
        want = 0o700 if path.is_dir() else 0o600
        assert mode & 0o077 == 0, f"{path} is {oct(mode)}, expected {oct(want)}"
        seen += 1
    assert seen > 10


def test_restore_from_disk_never_unpickles(backend, store_root: Path, monkeypatch) -> None:
    import torch

    from spoolctl.controllers.pytorch import PyTorchCacheController

    with PyTorchCacheController(backend, str(store_root)) as ctl:
        cold = ctl.generate(_params(), QUESTION, 5).tokens

    def refuse(*_a, **_k):
        raise AssertionError("unpickling on a load path")

    for target, name in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"),
                         (torch, "load")):
        monkeypatch.setattr(target, name, refuse)
    with PyTorchCacheController(backend, str(store_root)) as ctl:
        assert ctl.prepare(_params()).source == "disk"
        assert ctl.generate(_params(), QUESTION, 5).tokens == cold


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return script(*argv, env=env, timeout=60)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="chowning a store to another user needs root")
def test_cli_refuses_a_foreign_owned_root_unless_forced(store_root: Path) -> None:
    with Store.open(store_root, create=True) as store:
        store.put(kind="pytorch", namespace="n", key="k", objects={"kv": b"x" * 10})
    for path in [store_root, *store_root.rglob("*")]:
        os.lchown(path, 65534, 65534)
    env = {k: v for k, v in os.environ.items() if k != "SPOOLCTL_ALLOW_FOREIGN_OWNER"}
    for argv in (["status"], ["ls"], ["clean", "--yes"], ["scrub"]):
        proc = subprocess.run([str(Path(sys.executable).with_name("spoolctl")), *argv,
                               "--root", str(store_root)], capture_output=True, text=True,
                              timeout=60, env=env)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert proc.stderr.count("\n") == 1 and "--allow-foreign-owner" in proc.stderr
    # nothing was written by the refused commands
    assert all(p.stat().st_uid == 65534 for p in store_root.rglob("*"))
    proc = subprocess.run([str(Path(sys.executable).with_name("spoolctl")),
                           "--allow-foreign-owner", "ls", "--root", str(store_root), "--json"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert '"count": 1' in proc.stdout
