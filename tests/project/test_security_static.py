"""Static security checks over the package source: no pickle on any load path."""

from __future__ import annotations

import ast

from testpaths import REPO_DIR

PACKAGE = REPO_DIR / "spoolctl"

# Calls that can execute code embedded in a file.
FORBIDDEN_CALLS = {
    ("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"),
    ("torch", "load"), ("dill", "load"), ("dill", "loads"), ("joblib", "load"),
    ("marshal", "load"), ("marshal", "loads"), ("shelve", "open"),
}


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            base = node.func.value
            if isinstance(base, ast.Name):
                yield base.id, node.func.attr, node


# No exception: the forked, bounded reader of ``status``/``metrics`` (``cli/disk_deadline``,
# decision 2701) hands its result back as JSON (decision 2712), so no byte is unpickled
# anywhere in the package.


def test_no_unpickling_anywhere_in_the_package() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names]
                module = getattr(node, "module", None) or ""
                if "pickle" in names or module == "pickle" or "dill" in names:
                    offenders.append(f"{path}:{node.lineno} imports pickle")
        for base, attr, node in _calls(tree):
            if (base, attr) in FORBIDDEN_CALLS:
                offenders.append(f"{path}:{node.lineno} calls {base}.{attr}")
            if attr == "load" and base in {"np", "numpy"}:
                for kw in node.keywords:
                    if kw.arg == "allow_pickle" and not (
                        isinstance(kw.value, ast.Constant) and kw.value.value is False
                    ):
                        offenders.append(f"{path}:{node.lineno} numpy.load(allow_pickle)")
    assert offenders == []
