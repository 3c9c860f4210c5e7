"""Unknown keyword arguments to a controller's public calls become one ``ConfigError``.

Python's own refusal (``TypeError: CacheUse.generate() got an unexpected keyword argument
'max_tokens'``) names the internal part a call is forwarded to and not the options it takes.
``strict_options(cls)`` wraps ``__init__`` and every public method defined on ``cls`` so
that a keyword it does not take is refused naming the controller, the argument, the closest
option and every accepted one. Only keyword names are checked (one set lookup per call);
whatever else goes wrong inside the call is untouched.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from spoolctl.errors import ConfigError

T = TypeVar("T", bound=type)
_MARK = "_spoolctl_strict"


def accepted_options(fn: Callable[..., Any]) -> list[str]:
    """The keyword names ``fn`` takes (``self`` and positional-only ones left out)."""
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _strict(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    params = inspect.signature(fn).parameters.values()
    if getattr(fn, _MARK, False) or any(p.kind is p.VAR_KEYWORD for p in params):
        return fn
    allowed = frozenset(accepted_options(fn))

    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if kwargs and not allowed.issuperset(kwargs):
            unknown = sorted(set(kwargs) - allowed)[0]
            near = difflib.get_close_matches(unknown, sorted(allowed), n=1)
            hint = f"did you mean {near[0]}=? " if near else ""
            # the class the caller used, not the base that defines the method
            owner = type(args[0]).__name__ if args else fn.__qualname__.split(".")[0]
            where = owner if name == "__init__" else f"{owner}.{name}"
            raise ConfigError(f"{where}() takes no argument {unknown!r}",
                              fix=f"{hint}it takes: {', '.join(sorted(allowed))}")

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def acall(*args: Any, **kwargs: Any) -> Any:
            check(args, kwargs)
            return await fn(*args, **kwargs)
        setattr(acall, _MARK, True)
        return acall

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        check(args, kwargs)
        return fn(*args, **kwargs)

    setattr(call, _MARK, True)
    return call


def strict_options(cls: T) -> T:
    """``cls`` with ``__init__`` and its public methods refusing unknown keywords (see the
    module docstring); methods inherited from a base are the base's to wrap."""
    for name, value in list(vars(cls).items()):
        if inspect.isfunction(value) and (name == "__init__" or not name.startswith("_")):
            setattr(cls, name, _strict(value, name))
    return cls
