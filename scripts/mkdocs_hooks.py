"""MkDocs hooks for the spoolctl site (referenced from mkdocs.yml).

* ``on_pre_build``: fails the build (an error in ``--strict`` mode) when ``docs/cli.md``
  differs from what ``scripts/gen_cli_docs.py`` renders from the typer app now, so the
  CLI reference can never drift from the code.
* ``on_pre_build`` also fails it when the grouped decision index in ``docs/decisions.md``
  differs from what ``scripts/gen_decisions_index.py`` renders from ``docs/decisions/``
  (the index is in the page itself, so the repository view shows it too).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

log = logging.getLogger("mkdocs.plugins.spoolctl")
REPO = Path(__file__).resolve().parent.parent


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gen_cli_docs():
    return _script("gen_cli_docs")


def on_pre_build(config, **kwargs) -> None:
    gen = _gen_cli_docs()
    current = gen.OUTPUT.read_text() if gen.OUTPUT.exists() else ""
    if current != gen.render():
        log.warning("docs/cli.md is out of date with the typer app: run "
                    "`python scripts/gen_cli_docs.py`")
    index = _script("gen_decisions_index")
    if index.OUTPUT.read_text(encoding="utf-8") != index.render():
        log.warning("docs/decisions.md's index is out of date with docs/decisions/: run "
                    "`python scripts/gen_decisions_index.py`")
