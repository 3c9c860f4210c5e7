"""The structure checker (scripts/check_structure.py, run by `bash scripts/run.sh lint`) finds
what it promises: an import circle (also under TYPE_CHECKING), a long class, a private read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from testpaths import REPO_DIR

sys.path.insert(0, str(REPO_DIR / "scripts"))
import check_structure

pytestmark = pytest.mark.base


def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    modules = {}
    for name, text in files.items():
        path = tmp_path / (name.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        modules[name.removesuffix(".__init__")] = path
    return modules


def test_a_circle_through_a_type_checking_import_is_found(tmp_path: Path) -> None:
    modules = _package(tmp_path, {
        "pkg.__init__": "",
        "pkg.a": "from pkg.b import B\n",
        "pkg.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n",
        "pkg.c": "from . import a\n",
    })
    loops = check_structure.circles(check_structure.import_graph(modules))
    assert loops == [["pkg.a", "pkg.b"]]


def test_a_module_using_its_own_package_face_is_no_circle(tmp_path: Path) -> None:
    modules = _package(tmp_path, {
        "pkg.__init__": "from pkg.a import A\n",
        "pkg.a": "import pkg\nA = 1\n",
    })
    assert check_structure.circles(check_structure.import_graph(modules)) == []


def test_sizes_name_a_long_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(check_structure.LIMITS["class_lines"] + 1))
    modules = _package(tmp_path, {"pkg.big": "class Big:\n" + body})
    monkeypatch.setattr(check_structure, "REPO", tmp_path)
    breaches = check_structure.sizes(modules)
    assert len(breaches) == 1 and "class Big" in breaches[0]


def test_the_log_reference_pattern_finds_each_form() -> None:
    line = "# decision 2760; see issue 48 and docs/decisions/3000-x.md; 2 decisions ago"
    found = [m.group(0) for m in check_structure.LOG_REFERENCE.finditer(line)]
    assert found == ["decision 2760", "issue 48", "docs/decisions/3"]


def test_private_reads_count_attributes_and_imports(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_x.py").write_text(
        "from spoolctl.x import _hidden, shown\nobj._state\nself._ok\nobj.__dict__\n")
    reads = check_structure.private_reads(tests)
    assert [r.rsplit(": ", 1)[1] for r in reads] == ["_hidden", "_state"]
