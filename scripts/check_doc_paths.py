"""Fail when the docs or the README name a module, file or folder that is not in the tree.

    python scripts/check_doc_paths.py          # exit 0, or 1 and one line per stale mention

Checked pages: ``README.md`` and every ``docs/**/*.md`` except ``docs/decisions/`` (the
records are history: they name what existed when they were written) and the generated
decision list in ``docs/decisions.md`` (it repeats the records' titles).

What counts as a mention, and how it is resolved:

* a path under a top-level folder of the repository (``spoolctl/store/disk/fsio.py``,
  ``tests/test_docs.py``, ``scripts/bench_store.py``, ``examples/prometheus/``): it must
  exist from the repository root, or from the page's own folder (a relative link);
* a ``.py`` path or a folder ending in ``/`` written relative to a package
  (``planning/messages.py``, ``store/disk/``), recognised because its first folder is a
  folder name somewhere under ``spoolctl/``: some file or folder under ``spoolctl/`` must
  end with that path;
* a test's name in backticks (`` `test_doctor_reports_...` ``): some ``tests/`` module
  defines it;
* a dotted name starting ``spoolctl.`` (``spoolctl.store.disk.fsio``,
  ``spoolctl.store.Store.open``): its longest prefix that is a module must be followed, if
  anything, by a name that module's source mentions.

Other paths (absolute paths, URLs, vLLM's own ``worker/utils.py``, a store's
``state/keyring.json``) are not the tree's and are not checked.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "spoolctl"
TOP_DIRS = ("spoolctl", "tests", "scripts", "examples", "docs")
SKIP_DIRS = ("docs/decisions/",)
GENERATED = [("docs/decisions.md", "<!-- decisions:start", "<!-- decisions:end")]

URL = re.compile(r"\b[a-z][a-z+.-]*://\S+")
PATH = re.compile(r"(?<![\w./~$*-])((?:[\w.*-]+/)+[\w.*-]*)")
TEST_NAME = re.compile(r"(?<![\w.])(test_\w+)`")
#: Strings that look like a path of the tree but are not one (key-derivation labels).
NOT_PATHS = {"spoolctl/v1"}
DOTTED = re.compile(r"(?<![\w./-])spoolctl(?:\.\w+)+")
FILE_SUFFIX = re.compile(r"\.(py|sh|md|yml|yaml|toml|json|txt|cfg|ini)$")


@dataclass(frozen=True)
class Stale:
    page: str
    line: int
    mention: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: `{self.mention}` is not in the tree"


def pages(repo: Path) -> list[Path]:
    """README.md and the docs pages this check covers, sorted."""
    found = [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]
    return [p for p in found if p.is_file()
            and not str(p.relative_to(repo)).startswith(SKIP_DIRS)]


def page_lines(repo: Path, page: Path) -> Iterator[tuple[int, str]]:
    """(number, text) of each line of a page, generated blocks left out."""
    rel = str(page.relative_to(repo))
    inside = False
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        for name, start, end in GENERATED:
            if rel == name and line.startswith(start):
                inside = True
            elif rel == name and line.startswith(end):
                inside = False
        if not inside:
            yield n, line


class Tree:
    """The repository's files, for the lookups the check makes."""

    def __init__(self, repo: Path) -> None:
        self.repo = repo
        pkg = repo / PACKAGE
        self.package_files = [str(p.relative_to(pkg)) for p in pkg.rglob("*")
                              if p.is_file() and "__pycache__" not in p.parts]
        dirs = [p for p in pkg.rglob("*") if p.is_dir() and p.name != "__pycache__"]
        self.package_paths = [str(p.relative_to(pkg)) for p in dirs]
        self.package_dirs = {p.name for p in dirs} | {PACKAGE}
        self.test_names = {m for p in (repo / "tests").rglob("*.py")
                           for m in re.findall(r"^\s*(?:async )?def (test_\w+)",
                                               p.read_text(encoding="utf-8"), flags=re.M)}

    def path_ok(self, mention: str, page: Path) -> bool | None:
        """True: it exists; False: stale; None: not a path of this tree."""
        path = mention.rstrip(".").rstrip("/")
        if not path or path.startswith(".") or path in NOT_PATHS:
            return None
        first = path.split("/")[0]
        if "*" in path:
            return None if first not in TOP_DIRS else any(self.repo.glob(path))
        if first in TOP_DIRS:
            return (self.repo / path).exists() or (page.parent / path).exists()
        if (page.parent / path).exists():
            return True
        if first in self.package_dirs and path.endswith(".py"):
            return any(f == path or f.endswith("/" + path) for f in self.package_files)
        if first in self.package_dirs and mention.endswith("/"):
            return any(d == path or d.endswith("/" + path) for d in self.package_paths)
        return None

    def dotted_ok(self, mention: str) -> bool:
        """The longest module prefix exists and mentions the first name after it."""
        parts = mention.split(".")
        base = self.repo
        source = ""
        for i, part in enumerate(parts):
            as_dir, as_file = base / part, base / f"{part}.py"
            if (as_dir / "__init__.py").is_file():
                base, source = as_dir, (as_dir / "__init__.py").read_text(encoding="utf-8")
            elif as_file.is_file():
                return i == len(parts) - 1 or self._names(as_file, parts[i + 1])
            elif i == 0:
                return False
            else:
                return re.search(rf"\b{re.escape(part)}\b", source) is not None
        return True

    @staticmethod
    def _names(module: Path, name: str) -> bool:
        return re.search(rf"\b{re.escape(name)}\b", module.read_text(encoding="utf-8")) is not None


def stale_mentions(repo: Path = REPO) -> list[Stale]:
    """Every stale mention in the checked pages, in page and line order."""
    tree = Tree(repo)
    out: list[Stale] = []
    for page in pages(repo):
        rel = str(page.relative_to(repo))
        for n, line in page_lines(repo, page):
            text = URL.sub(" ", line)
            for m in PATH.finditer(text):
                mention = m.group(1).rstrip(".")
                if tree.path_ok(mention, page) is False:
                    out.append(Stale(rel, n, mention))
            for m in TEST_NAME.finditer(text):
                if m.group(1) not in tree.test_names:
                    out.append(Stale(rel, n, m.group(1)))
            for m in DOTTED.finditer(text):
                mention = m.group(0)
                if FILE_SUFFIX.search(mention) is None and not tree.dotted_ok(mention):
                    out.append(Stale(rel, n, mention))
    return out


def main() -> int:
    stale = stale_mentions()
    for item in stale:
        print(item)
    if stale:
        print(f"check_doc_paths: {len(stale)} stale mention(s); fix the page (or the path) "
              "so each names a file, folder or module that exists", file=sys.stderr)
        return 1
    print(f"check_doc_paths: every path and module the {len(pages(REPO))} pages name exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
