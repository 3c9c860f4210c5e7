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
    """Module -> the modules under the same folder it imports, named by their dotted path
    below ``folder`` (``store``, ``maintain.gc``; a package by its own name): every relative
    or absolute import, at any depth (``TYPE_CHECKING`` blocks and function bodies too: a
    circle of type-only imports is still a circle a reader has to untangle). Cached:
    callers must not change it."""
    base = ".".join(folder.relative_to(PACKAGE.parent).parts)
    paths = {}
    for path in folder.rglob("*.py"):
        parts = path.relative_to(folder).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        here = f"{base}.{name}" if name else base
        package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for full in (target, *(f"{target}.{a.name}" for a in node.names)):
                if full.startswith(base + "."):
                    found.add(full[len(base) + 1:])
        graph[name] = found & set(paths) - {name, ""}
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
    assert {"commit.committer", "maintain.gc", "maintain.recovery", "maintain.quarantining",
            "catalog.health", "queries", "facts", "maintain.clean"} <= parts
    assert sorted(m for m in parts if "store" in graph[m]) == []
    circle = [c for c in circles(graph) if "store" in c]
    assert circle == []


def test_the_store_has_no_import_circle() -> None:
    """Any new circle in the store fails here (the last one, doctor and its scan, was
    broken by decision 2530; import-linter's acyclic contract checks the same in CI)."""
    assert circles(imports_of(PACKAGE / "store")) == []


def test_the_local_controller_and_its_use_part_import_one_way() -> None:
    """``local_use`` (generate, restore, import_cache) receives a ``UseContext``, not the
    controller: it does not import ``local`` (the two imported each other before)."""
    graph = imports_of(PACKAGE / "controllers")
    assert "local.use" in graph["local.engine"]
    assert "local.engine" not in below(graph, "local.use")
    assert [c for c in circles(graph) if "local.engine" in c] == []


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
