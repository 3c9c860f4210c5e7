"""Shared CLI plumbing: the --root/--json options, exit codes, and the one output sink.

Output: a command's result is one JSON-ready document. ``emit`` prints it as JSON for
scripts (``--json``), or hands it to the command's *view* (document -> rich renderables)
for people. A command prints its result no other way, so both outputs come from the same
data and cannot drift apart.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, RenderableType

from spoolctl.store import Store

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
ENV_ROOT = "SPOOLCTL_ROOT"


def default_root() -> Path:
    """$SPOOLCTL_ROOT, else the user's cache dir (XDG on Linux, ~/Library/Caches on macOS)."""
    env = os.environ.get(ENV_ROOT)
    if env:
        return Path(env)
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "spoolctl"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spoolctl"


def default_store_root() -> Path:
    """Where the store lives inside the cache dir (models etc. live beside it)."""
    env = os.environ.get(ENV_ROOT)
    return Path(env) if env else default_root() / "store"


RootOption = Annotated[
    Path | None,
    typer.Option("--root", help=f"Store root (absolute). Default: ${ENV_ROOT}, else "
                 "~/.cache/spoolctl/store.", show_default=False),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]

# stdout carries results (tables or JSON); stderr carries errors and progress.
console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


def resolve_root(root: Path | None) -> Path:
    return root if root is not None else default_store_root()


def open_store(root: Path | None, *, create: bool = False, max_bytes: int | None = None) -> Store:
    return Store.open(str(resolve_root(root)), create=create, max_bytes=max_bytes)


def emit_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


View = Callable[[Any], "RenderableType | list[RenderableType]"]


def emit(doc: Any, *, json_output: bool, view: View) -> None:
    """Print ``doc`` as JSON (``json_output``) or as what ``view(doc)`` renders, on stdout.

    A view returns one renderable or a list of them; a ``str`` is rich markup, a
    ``rich.text.Text`` is printed as is (use it for text that came from the store).
    """
    if json_output:
        emit_json(doc)
        return
    shown = view(doc)
    for renderable in shown if isinstance(shown, list) else [shown]:
        console.print(renderable)
