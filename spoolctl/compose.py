"""Composition helper: a facade method that forwards to the same method of one of its
parts.

``Store`` and ``LocalCacheController`` are composed of parts, not mixed from them; the
methods users call stay on the facade. ``forward`` writes one of them in one line, with
the part's docstring and signature (``help()``, the docs), instead of a hand-written
wrapper that repeats every parameter::

    class Store:
        totals = forward(Queries.totals, "_queries")   # self._queries.totals(...)

No framework and nothing of spoolctl is imported here: every package may use it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def forward(method: Callable[..., Any], part: str) -> Any:
    """A class attribute that becomes ``owner.<name>``, a method calling
    ``self.<part>.<method name>`` with the same arguments (see the module docstring).

    Typed ``Any``: to a type checker the attribute is whatever it is called with; at run
    time it is a plain function with the part's signature and docstring."""
    return _Forward(method, part)


class _Forward:
    def __init__(self, method: Callable[..., Any], part: str):
        self._method = method
        self._part = part

    def __set_name__(self, owner: type, name: str) -> None:
        method, part, target = self._method, self._part, self._method.__name__

        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(getattr(self, part), target)(*args, **kwargs)
        call.__name__, call.__qualname__ = name, f"{owner.__qualname__}.{name}"
        setattr(owner, name, call)
