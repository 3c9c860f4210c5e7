"""The build's version: the release in ``spoolctl/__init__.py`` plus the commit it is built
from (``0.1.0+g<12 hex>``), recorded in ``spoolctl/_build.py`` of the wheel and the sdist
(``spoolctl/version.py`` reads it). Everything else is in pyproject.toml."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
BUILD_FILE = Path("spoolctl") / "_build.py"


def _commit() -> str | None:
    """HEAD of the checkout this is built from; in an unpacked sdist, the recorded one."""
    try:
        top = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=30)
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == HERE:
            head = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short=12", "HEAD"],
                                  capture_output=True, text=True, timeout=30)
            if head.returncode == 0 and re.fullmatch(r"[0-9a-f]{12}", head.stdout.strip()):
                return head.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    recorded = HERE / BUILD_FILE
    found = re.search(r'COMMIT = "([0-9a-f]{7,40})"', recorded.read_text()) \
        if recorded.is_file() else None
    return found.group(1) if found else None


def _release() -> str:
    text = (HERE / "spoolctl" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


COMMIT = _commit()


def _record(base: Path) -> None:
    if COMMIT is not None:
        (base / BUILD_FILE).write_text(f'"""Written by setup.py at build time."""\n\n'
                                       f'COMMIT = "{COMMIT}"\n')


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        _record(Path(self.build_lib))


class Sdist(sdist):
    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        _record(Path(base_dir))


setup(version=f"{_release()}+g{COMMIT}" if COMMIT else _release(),
      cmdclass={"build_py": BuildPy, "sdist": Sdist})
