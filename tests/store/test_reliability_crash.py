"""Crash matrix, CI-sized: one repetition of every trial of ``scripts/crash_matrix.py``.

A real process dies (``os._exit`` at ``SPOOLCTL_CRASH_AT``) while a PyTorch or MLX controller
``prepare`` commits, or while ``spoolctl scrub`` saves progress. Afterwards: the entry is
complete or absent (present once its manifest was durable), no committed entry is lost,
``prepare`` again gives greedy tokens equal to a cold run, and
``spoolctl clean --min-age 0s --yes`` leaves no temp file or unreferenced object.
The store-level points (commit/clean/evict/quarantine) are in ``tests/store/test_store_crash.py``.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
from testpaths import REPO_DIR

sys.path.insert(0, str(REPO_DIR / "scripts"))
import crash_matrix as cm


@pytest.fixture(scope="module")
def torch_trials(tiny_model_dir: Path) -> cm.ControllerTrials:
    return cm.ControllerTrials("pytorch", tiny_model_dir)


@pytest.fixture(scope="module")
def mlx_trials(tiny_model_dir: Path) -> cm.ControllerTrials:
    if importlib.util.find_spec("mlx_lm") is None:
        pytest.skip("mlx-lm is not installed (pip install 'mlx-lm[cpu]')")
    try:
        return cm.ControllerTrials("mlx", tiny_model_dir)
    except ImportError as exc:  # e.g. mlx without its native library
        pytest.skip(f"mlx cannot load here: {exc}")


# The default run kills the controller on either side of the manifest-last boundary and at
# the first and last step; every other point runs with ``-m extended`` (the store-level
# matrix in tests/store/test_store_crash.py covers every point in the default run).
_DEFAULT_POINTS = ("object.tmp_written", "manifest.tmp_written", "manifest.published",
                   "catalog.committed")


@pytest.mark.parametrize("point", [
    p if p in _DEFAULT_POINTS else pytest.param(p, marks=pytest.mark.extended)
    for p in cm.COMMIT_POINTS])
def test_pytorch_prepare_killed_at_commit_checkpoint(torch_trials, store_root: Path,
                                                     point: str) -> None:
    result = torch_trials.trial(store_root, point)
    assert result["crashed"], f"the child never reached {point}"
    assert result["problems"] == []
    expected = "disk" if point in cm.DURABLE_POINTS else "cold"
    assert result["source_after"] == expected


# MLX: the points on either side of the manifest-last boundary (the full list runs in
# scripts/crash_matrix.py --only mlx) to keep CI bounded.
@pytest.mark.parametrize("point", ["manifest.tmp_written", "manifest.published"])
def test_mlx_prepare_killed_at_commit_checkpoint(mlx_trials, store_root: Path,
                                                 point: str) -> None:
    result = mlx_trials.trial(store_root, point)
    assert result["crashed"], f"the child never reached {point}"
    assert result["problems"] == []


# Group commit: either side of the manifest-last boundary and the middle of the renames (every
# point and pass runs in tests/store/test_store_crash.py and scripts/crash_matrix.py --only batch).
@pytest.mark.parametrize("point", ["object.dir_fsynced:2", "catalog.intent:1",
                                   "manifest.published:4", "manifest.dir_fsynced:1"])
def test_group_commit_killed_at_a_checkpoint_of_the_batch(store_root: Path, point: str) -> None:
    result = cm.batch_trial(store_root, point)
    assert result["crashed"], f"the worker never reached {point}"
    assert result["problems"] == []


def test_batch_points_cover_every_commit_checkpoint() -> None:
    from spoolctl.store.disk.faults import COMMIT_CHECKPOINTS

    assert cm.COMMIT_POINTS == COMMIT_CHECKPOINTS
    assert {p.partition(":")[0] for p in cm.batch_points()} == set(COMMIT_CHECKPOINTS)


@pytest.mark.parametrize("nth", [1, 3, 6])
def test_scrub_killed_at_progress_save_resumes(store_root: Path, nth: int) -> None:
    result = cm.scrub_trial(store_root, nth, random.Random(nth))
    assert result["crashed"], "scrub never reached the progress save"
    assert result["problems"] == []


def test_invariant_checks_catch_a_lost_entry(torch_trials, store_root: Path) -> None:
    """The checker itself is not blind: an entry deleted behind its back is reported."""
    from spoolctl.store import Store

    torch_trials._generate(store_root, torch_trials.params["survivor"])
    with Store.open(store_root) as store:
        entry_id = store.entries()[0].entry_id
        obj = store.layout.object_path(store.manifest(entry_id).objects[0].digest)
    obj.write_bytes(obj.read_bytes()[:-1])
    assert cm.check_store(store_root) != []
    assert cm.check_reclaimed(store_root) == []  # clean quarantined it; nothing left over
