"""``delegate``: ``compose.forward`` with the part method's type kept, for the store's
facades (``Store``, ``Catalog``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from spoolctl.compose import forward

P = ParamSpec("P")
R = TypeVar("R")


def delegate(method: Callable[Concatenate[Any, P], R], part: str
             ) -> Callable[Concatenate[Any, P], R]:
    """A facade attribute that calls ``self.<part>.<method name>`` with the same arguments
    and type-checks as ``method``."""
    typed: Callable[Concatenate[Any, P], R] = forward(method, part)
    return typed
