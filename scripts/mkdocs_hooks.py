"""MkDocs hooks for the spoolctl site (referenced from mkdocs.yml).

* ``on_pre_build``: fails the build (an error in ``--strict`` mode) when ``docs/cli.md``
  differs from what ``scripts/gen_cli_docs.py`` renders from the typer app now, so the
  CLI reference can never drift from the code.
* ``on_page_markdown``: fills the ``<!-- decisions -->`` marker of ``decisions.md`` with a
  list of every ``docs/decisions/NNNN-*.md`` (title from its first heading), so a new
  decision record needs no index edit.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path

log = logging.getLogger("mkdocs.plugins.spoolctl")
REPO = Path(__file__).resolve().parent.parent
MARKER = "<!-- decisions -->"


def _gen_cli_docs():
    spec = importlib.util.spec_from_file_location("gen_cli_docs", REPO / "scripts" /
                                                  "gen_cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_pre_build(config, **kwargs) -> None:
    gen = _gen_cli_docs()
    current = gen.OUTPUT.read_text() if gen.OUTPUT.exists() else ""
    if current != gen.render():
        log.warning("docs/cli.md is out of date with the typer app: run "
                    "`python scripts/gen_cli_docs.py`")


def decision_index(decisions_dir: Path) -> str:
    """A Markdown list linking every decision record, in number order (pure)."""
    lines = []
    for path in sorted(decisions_dir.glob("[0-9][0-9][0-9][0-9]-*.md")):
        title = path.stem
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("# "):
                title = line[2:].strip()
                break
        title = re.sub(r"\s+", " ", title).replace("[", "\\[").replace("]", "\\]")
        lines.append(f"- [{title}](decisions/{path.name})")
    return "\n".join(lines) if lines else "_No decision records yet._"


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    if page.file.src_uri == "decisions.md" and MARKER in markdown:
        return markdown.replace(MARKER, decision_index(Path(config["docs_dir"]) / "decisions"))
    return markdown
