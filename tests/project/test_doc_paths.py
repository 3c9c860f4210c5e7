"""Every module, file and folder the docs and the README name exists.

The check is scripts/check_doc_paths.py; these tests run it and show what it catches.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from testpaths import REPO_DIR

pytestmark = pytest.mark.base

REPO = REPO_DIR
SCRIPT = REPO / "scripts" / "check_doc_paths.py"


def _checker():
    spec = importlib.util.spec_from_file_location("check_doc_paths", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_every_path_the_docs_name_exists() -> None:
    stale = _checker().stale_mentions(REPO)
    assert not stale, "stale mentions in the docs:\n" + "\n".join(map(str, stale))


def _tree(tmp_path: Path, page: str) -> Path:
    for path in ("spoolctl/__init__.py", "spoolctl/connector/__init__.py",
                 "spoolctl/connector/planning/__init__.py", "scripts/bench_store.py",
                 "docs/decisions/0001-x.md"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    (tmp_path / "spoolctl/connector/planning/messages.py").write_text("class SpoolMeta: ...\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_a.py").write_text("def test_real():\n    pass\n")
    (tmp_path / "README.md").write_text("")
    (tmp_path / "docs/page.md").write_text(page)
    (tmp_path / "docs/decisions/0001-x.md").write_text("`spoolctl/gone.py` existed then\n")
    return tmp_path


def test_live_mentions_in_every_form_pass(tmp_path: Path) -> None:
    repo = _tree(tmp_path, "\n".join([
        "`spoolctl/connector/planning/messages.py` and `planning/messages.py`, `planning/`",
        "`spoolctl.connector.planning.messages.SpoolMeta`, `spoolctl.connector`",
        "[a record](decisions/0001-x.md), `scripts/bench_*.py`, `tests/test_a.py`",
        "`test_real`, vLLM's own `worker/utils.py`, /etc/spoolctl/x.yml, a store's `state/k.json`",
        "https://example.com/spoolctl/gone.py"]))
    assert _checker().stale_mentions(repo) == []


def test_each_stale_form_is_named_with_its_page_and_line(tmp_path: Path) -> None:
    repo = _tree(tmp_path, "\n".join([
        "intro",
        "`spoolctl/connector/planning/gone.py`",
        "`planning/old_messages.py` and `connector/drives/`",
        "`spoolctl.connector.genai_records`",
        "`spoolctl.connector.planning.messages.OldMeta`",
        "`scripts/bench_gone.py` and `tests/test_b*.py`",
        "`test_renamed_away`"]))
    found = [str(s) for s in _checker().stale_mentions(repo)]
    assert found == [
        "docs/page.md:2: `spoolctl/connector/planning/gone.py` is not in the tree",
        "docs/page.md:3: `planning/old_messages.py` is not in the tree",
        "docs/page.md:3: `connector/drives/` is not in the tree",
        "docs/page.md:4: `spoolctl.connector.genai_records` is not in the tree",
        "docs/page.md:5: `spoolctl.connector.planning.messages.OldMeta` is not in the tree",
        "docs/page.md:6: `scripts/bench_gone.py` is not in the tree",
        "docs/page.md:6: `tests/test_b*.py` is not in the tree",
        "docs/page.md:7: `test_renamed_away` is not in the tree",
    ]


def test_the_script_exits_1_and_prints_one_line_per_stale_mention(tmp_path: Path) -> None:
    repo = _tree(tmp_path, "`spoolctl/gone.py`\n")
    (repo / "scripts" / SCRIPT.name).write_text(SCRIPT.read_text())
    stale = subprocess.run([sys.executable, f"scripts/{SCRIPT.name}"], capture_output=True,
                           text=True, cwd=repo, check=False)
    assert stale.returncode == 1
    assert stale.stdout == "docs/page.md:1: `spoolctl/gone.py` is not in the tree\n"
    assert "1 stale mention" in stale.stderr
    ok = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                        cwd=REPO, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
