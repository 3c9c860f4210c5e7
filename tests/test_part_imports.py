"""The store and the local controller are composed of parts, not mixed from them
(decision 2520): the parts under ``Store`` never import ``store.py``, no module of the
store imports in a circle with another, ``local_use`` does not import ``local``, and
neither facade has base classes."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import spoolctl

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

PACKAGE = Path(spoolctl.__file__).parent


@functools.cache
def imports_of(folder: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same folder it imports: every ``from . import x`` /
    ``from .x import y``, at any depth (``TYPE_CHECKING`` blocks and function bodies
    too: a circle of type-only imports is still a circle a reader has to untangle).
    Cached: callers must not change it."""
    modules = {p.stem for p in folder.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name in modules:
        tree = ast.parse((folder / f"{name}.py").read_text(encoding="utf-8"))
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module.split(".")[0]} if node.module else \
                    {alias.name for alias in node.names}
        graph[name] = found & modules - {name}
    return graph


def below(graph: dict[str, set[str]], top: str) -> set[str]:
    """Every module ``top`` imports, directly or through others."""
    seen: set[str] = set()
    todo = list(graph[top])
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    return seen


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The import circles (modules that reach each other), each once."""
    reach = {name: below(graph, name) for name in graph}
    found: list[set[str]] = []
    for name in sorted(graph):
        circle = {name} | {m for m in reach[name] if name in reach[m]}
        if len(circle) > 1 and circle not in found:
            found.append(circle)
    return found


def test_no_store_module_below_the_facade_imports_it() -> None:
    """The parts (commit, gc, recovery, quarantine, catalog repair, queries, facts, clean)
    receive a narrow context, not the ``Store``: none of them, nor anything they import,
    imports ``store.py`` (a 10-module circle before)."""
    graph = imports_of(PACKAGE / "store")
    parts = below(graph, "store")
    assert {"commit", "gc", "recovery", "quarantining", "catalog_health", "queries",
            "facts", "clean"} <= parts
    assert sorted(m for m in parts if "store" in graph[m]) == []
    circle = [c for c in circles(graph) if "store" in c]
    assert circle == []


def test_the_only_store_circle_is_doctor_and_its_scan() -> None:
    """Any new circle in the store fails here (doctor/doctor_scan is the known one left,
    named in the issue's other items)."""
    assert circles(imports_of(PACKAGE / "store")) in ([], [{"doctor", "doctor_scan"}])


def test_the_local_controller_and_its_use_part_import_one_way() -> None:
    """``local_use`` (generate, restore, import_cache) receives a ``UseContext``, not the
    controller: it does not import ``local`` (the two imported each other before)."""
    graph = imports_of(PACKAGE / "controllers")
    assert "local_use" in graph["local"]
    assert "local" not in below(graph, "local_use")
    assert [c for c in circles(graph) if "local" in c] == []


def test_the_facades_have_no_mixins() -> None:
    from spoolctl.controllers import LocalCacheController
    from spoolctl.store import Store

    assert Store.__bases__ == (object,)
    assert LocalCacheController.__bases__ == (object,)


def test_forwarded_methods_keep_their_names_signatures_and_docs() -> None:
    """What ``help(Store.totals)`` and ``help(LocalCacheController.generate)`` show is the
    part's contract, under the facade's name."""
    import inspect

    from spoolctl.controllers import LocalCacheController
    from spoolctl.controllers.local.use import CacheUse
    from spoolctl.store import Store
    from spoolctl.store.queries import Queries

    for facade, part, name in ((Store, Queries, "resolve"), (Store, Queries, "entries"),
                               (LocalCacheController, CacheUse, "generate"),
                               (LocalCacheController, CacheUse, "import_cache")):
        method = getattr(facade, name)
        assert method.__qualname__ == f"{facade.__name__}.{name}"
        assert method.__doc__ == getattr(part, name).__doc__
        assert inspect.signature(method) == inspect.signature(getattr(part, name))
