"""Structure limits a newcomer relies on, checked on the tree (``bash scripts/run.sh lint``).

    python scripts/check_structure.py [--json]

Checks, each with its limit (``LIMITS``):

* no module of ``spoolctl/`` over 600 lines, no class over 400;
* references to the decision log or to issues in the package's code (``decision 2760``,
  ``issue 48``, ``docs/decisions/...``): fewer than 40 in all; a comment says its reason;
* no import circle between the package's modules (every import counts, also those under
  ``TYPE_CHECKING`` and inside functions, except a module importing its own package's
  ``__init__``);
* reads of private attributes in tests (``obj._name`` on anything but ``self``/``cls``, and
  ``from spoolctl... import _name``): fewer than 30;
* one drive set: no ``.several`` branch and no ``SEVERAL_DRIVES`` flag in the package;
* commit subjects after ``SUBJECTS_SINCE`` at most 72 characters (skipped, said, without git
  history).

Prints one line per breach (file, what, the limit) and exits 1; ``--json`` prints the figures.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "spoolctl"
TESTS = REPO / "tests"
LIMITS = {"module_lines": 600, "class_lines": 400, "log_references": 40,
          "private_reads_in_tests": 30, "several_branches": 0, "import_circles": 0,
          "subject_chars": 72}
# The first commit whose subject the rule binds; earlier history is left as it was written.
SUBJECTS_SINCE = "c196617"
LOG_REFERENCE = re.compile(r"\b[Dd]ecisions? \d{3,4}\b|\b[Ii]ssues? #?\d+\b|docs/decisions/\d")
SEVERAL = re.compile(r"\.several\b|\bSEVERAL_DRIVES\b")


def package_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def sizes(modules: dict[str, Path]) -> list[str]:
    breaches = []
    for path in modules.values():
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        rel = path.relative_to(REPO)
        if lines > LIMITS["module_lines"]:
            breaches.append(f"{rel}: {lines} lines (a module holds at most "
                            f"{LIMITS['module_lines']}: split it by role)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                span = node.end_lineno - node.lineno + 1
                if span > LIMITS["class_lines"]:
                    breaches.append(f"{rel}:{node.lineno}: class {node.name} has {span} lines "
                                    f"(at most {LIMITS['class_lines']})")
    return breaches


def log_references(modules: dict[str, Path]) -> list[str]:
    found = []
    for path in modules.values():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in LOG_REFERENCE.finditer(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {match.group(0)}")
    return found


def _imported(module: str, is_package: bool, node: ast.AST,
              modules: dict[str, Path]) -> list[str]:
    """The package modules one import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join([*base, *([node.module] if node.module else [])])
    else:
        target = node.module or ""
    out = []
    for alias in node.names:
        if f"{target}.{alias.name}" in modules:
            out.append(f"{target}.{alias.name}")
        elif target in modules:
            out.append(target)
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for target in _imported(name, is_package, node, modules):
                # a module reaching its own package's face is how a package is used, not a circle
                if target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def private_reads(tests: Path = TESTS) -> list[str]:
    found = []
    for path in sorted(tests.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute) and _private(node.attr):
                if not (isinstance(node.value, ast.Name)
                        and node.value.id in ("self", "cls", "os", "sys")):
                    name = node.attr
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("spoolctl"):
                name = next((a.name for a in node.names if _private(a.name)), None)
            if name:
                where = f"{path.relative_to(tests.parent)}:{getattr(node, 'lineno', 0)}"
                found.append(f"{where}: {name}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def several_branches(modules: dict[str, Path]) -> list[str]:
    return [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
            for path in modules.values()
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if SEVERAL.search(line)]


def long_subjects() -> tuple[list[str], str | None]:
    """Subjects over the limit since ``SUBJECTS_SINCE``; the second value says why unchecked."""
    proc = subprocess.run(["git", "log", "--format=%h %s", f"{SUBJECTS_SINCE}..HEAD"],
                          cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        return [], f"commit subjects not checked: no git history here ({proc.stderr.strip()})"
    limit = LIMITS["subject_chars"]
    return [line for line in proc.stdout.splitlines() if len(line.split(" ", 1)[1]) > limit], None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    modules = package_modules()
    size_breaches = sizes(modules)
    references = log_references(modules)
    loops = circles(import_graph(modules))
    reads = private_reads()
    several = several_branches(modules)
    subjects, subjects_skipped = long_subjects()
    breaches = list(size_breaches)
    if len(references) >= LIMITS["log_references"]:
        breaches.append(f"spoolctl/: {len(references)} references to the decision log or "
                        f"issues in code (fewer than {LIMITS['log_references']}): state the "
                        "reason in the comment; first ones: " + "; ".join(references[:5]))
    breaches += [f"import circle: {' -> '.join(loop)}" for loop in loops]
    if len(reads) >= LIMITS["private_reads_in_tests"]:
        breaches.append(f"tests/: {len(reads)} reads of private attributes (fewer than "
                        f"{LIMITS['private_reads_in_tests']}): use the public API or a "
                        "documented seam; first ones: " + "; ".join(reads[:5]))
    breaches += [f"{line}: a branch on several drives (one drive is a set of one)"
                 for line in several]
    breaches += [f"commit {line[:60]}...: subject over {LIMITS['subject_chars']} characters"
                 for line in subjects]
    if args.json:
        print(json.dumps({
            "limits": LIMITS, "modules": len(modules), "size_breaches": len(size_breaches),
            "log_references": len(references), "import_circles": loops,
            "private_reads_in_tests": len(reads), "several_branches": len(several),
            "long_subjects": len(subjects), "subjects_skipped": subjects_skipped,
            "breaches": len(breaches)}, indent=2))
    else:
        for line in breaches:
            print(f"check_structure: {line}")
        if subjects_skipped:
            print(f"check_structure: {subjects_skipped}")
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main())
