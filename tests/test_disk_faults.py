"""A disk that fails reads (issue 32, decision 2700), on a real FUSE filesystem the test
controls (``tests/fusefs.py`` mounted over a store's ``manifests/``): an EIO is a miss and
not a quarantine, and the entry reads again once the disk does."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import wait_until

from spoolctl.store import Store, StoreIOError, entry_id_for

HERE = Path(__file__).parent
# Where mfusepy is when it is not in the test environment itself (a local check).
FUSE_PATH = os.environ.get("SPOOLCTL_TEST_FUSE_PATH", "")


def _fuse_missing() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this host"
    if shutil.which("fusermount3") is None:
        return "fusermount3 missing (Debian fuse3; scripts/ci_tools.sh installs it)"
    env = {**os.environ, "PYTHONPATH": FUSE_PATH}
    if subprocess.run([sys.executable, "-c", "import mfusepy"], env=env,
                      capture_output=True).returncode:
        return "mfusepy not importable (the dev extra installs it)"
    return None


@pytest.fixture
def eio_manifests(tmp_path: Path):
    """A store whose ``manifests/`` is a FUSE mount; yields (store, control file): a line
    written to the control file makes reads of matching paths fail with EIO."""
    missing = _fuse_missing()
    if missing:
        pytest.skip(missing)
    root = Path(os.path.realpath(tmp_path)) / "rank-0000"
    with Store.open(root, create=True) as s:
        s.put(kind="vllm", namespace="ns", key="a" * 64, objects={"kv": b"x" * 1000})
    backing, control = tmp_path / "backing", tmp_path / "control"
    shutil.copytree(root / "manifests", backing)
    daemon = subprocess.Popen(
        [sys.executable, str(HERE / "fusefs.py"), str(backing), str(root / "manifests"),
         str(control)], env={**os.environ, "PYTHONPATH": FUSE_PATH},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: os.path.ismount(root / "manifests"), what="the FUSE mount")
        with Store.open(root) as store:
            yield store, control
    finally:
        subprocess.run(["fusermount3", "-u", str(root / "manifests")], capture_output=True)
        daemon.wait(timeout=30)


def test_an_eio_on_a_manifest_is_a_miss_not_a_quarantine(eio_manifests) -> None:
    store, control = eio_manifests
    entry = entry_id_for("vllm", "ns", "a" * 64)
    control.write_text(".json\n")  # the disk fails every manifest read
    with pytest.raises(StoreIOError, match="Input/output error"):
        store.manifest(entry)
    assert store.live([entry]) == {entry}  # still in the catalog
    assert not list((Path(store.root) / "quarantine").iterdir())  # nothing quarantined
    control.write_text("")  # the disk reads again: so does the entry
    assert store.manifest(entry).entry_id == entry
