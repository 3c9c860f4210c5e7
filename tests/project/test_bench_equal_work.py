"""The benchmarks' rule for a ratio against a peer: only over equal work (tokens restored,
blocks stored), never against a side that did less."""

from __future__ import annotations

import importlib.util

import pytest
from testpaths import REPO_DIR

pytestmark = pytest.mark.base


def _benchutil():
    spec = importlib.util.spec_from_file_location("benchutil",
                                                  REPO_DIR / "scripts" / "benchutil.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_equal_work_gives_the_ratio() -> None:
    ratio, why = _benchutil().equal_work_ratio(0.1, [8192, 8192], 0.2, [8192, 8192])
    assert (ratio, why) == (0.5, None)


@pytest.mark.parametrize(("ours", "peer", "who"), [
    ([8192, 8192], [8192, 6144], "the peer did less"),
    (4095, 4096, "ours did less"),
])
def test_unequal_work_is_refused_either_way(ours, peer, who) -> None:
    ratio, why = _benchutil().equal_work_ratio(0.1, ours, 0.2, peer)
    assert ratio is None and who in why


def test_a_missing_repeat_is_refused() -> None:
    ratio, why = _benchutil().equal_work_ratio(0.1, [1, 1], 0.2, [1])
    assert ratio is None and "2 measured runs against 1" in why


def test_the_test_side_copy_coalesces_runs_consecutive_on_both_sides(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO_DIR / "scripts"))
    spec = importlib.util.spec_from_file_location("bench_vllm",
                                                  REPO_DIR / "scripts" / "bench_vllm.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench._runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 7]) == [(4, 0, 3), (9, 3, 1), (10, 7, 1)]
    assert bench._runs([], []) == []
