"""Which params and which handle a ``generate`` call runs with: one rule for every controller.

``generate(target, prompt, ..., params=None)``:

* ``target`` is ``CachePrepareParams``: they are the query, prepared first (``params=``
  must not be given as well).
* ``target`` is a ``CacheHandle`` and ``params=`` is given: ``params`` is the query.
  An explicit argument always wins over what the controller remembers.
* ``target`` is a handle and ``params=`` is not given: the query is the params this
  controller prepared the handle for (an empty handle a ``prepare`` returned -- nothing
  cacheable, or a read-only miss -- included: the query then runs cold); a handle this
  controller did not make is a ConfigError.

The handle's cache is then used only if the handle is the entry the query maps to
(same model, cacheable prefix, tools, options -- and, for VLM prompts, the same
images). A handle of other params is refused with one WARNING line and the query
runs cold (``usage.cache_read_tokens == 0``): never a cache of another prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from spoolctl.errors import ConfigError

from .contract import CacheHandle, CachePrepareParams

FOREIGN_HANDLE = "the cache handle was prepared for other params; running this query cold"


def resolve_target(
    target: CachePrepareParams | CacheHandle,
    params: CachePrepareParams | None,
    known: Callable[[CacheHandle], CachePrepareParams | None],
) -> tuple[CachePrepareParams, CacheHandle | None]:
    """``(query params, handle)``; the handle is None when the caller must prepare the
    params first. ``known(handle)`` is the params this controller prepared ``handle``
    for (or None)."""
    if isinstance(target, CachePrepareParams):
        if params is not None:
            raise ConfigError("generate() got params twice (as the target and as params=)",
                              fix="pass the params as the target, or a handle with params=")
        return target, None
    if not isinstance(target, CacheHandle):
        raise ConfigError(f"generate() takes params or a handle, not {type(target).__name__}",
                          fix="pass CachePrepareParams or a CacheHandle")
    if params is None:
        params = known(target)
    if params is None:
        raise ConfigError("this handle was not prepared by this controller",
                          fix="pass the CachePrepareParams (or params=) instead")
    if not isinstance(params, CachePrepareParams):
        raise ConfigError(f"params= takes CachePrepareParams, not {type(params).__name__}",
                          fix="build CachePrepareParams(model=..., instructions=[...])")
    return params, target


def refuse_foreign(handle: CacheHandle, belongs: bool, log: logging.Logger) -> CacheHandle:
    """``handle`` if it ``belongs`` to the query (or is empty), else the empty handle
    after one WARNING line (no id in it: ids are derived from prompts)."""
    if handle and not belongs:
        log.warning(FOREIGN_HANDLE)
        return CacheHandle.empty()
    return handle


def ref_of(ref: Any) -> str | None:
    """What ``release`` is for: a handle's ref (None for the empty handle) or a ref string;
    anything else is a ConfigError naming the fix."""
    if isinstance(ref, CacheHandle):
        return ref.ref
    if not isinstance(ref, str):
        raise ConfigError(f"release() takes a CacheHandle or its ref, not {type(ref).__name__}",
                          fix="pass the handle prepare() returned")
    return ref


def hosted(params: Any) -> CachePrepareParams:
    """``params`` if a hosted controller can use them (typed, with a server model name)."""
    if not isinstance(params, CachePrepareParams):
        raise ConfigError(f"expected CachePrepareParams, not {type(params).__name__}",
                          fix="build CachePrepareParams(model=..., instructions=[...])")
    if params.model is None:
        raise ConfigError("a hosted controller needs params.model (the server's model name)",
                          fix='pass e.g. model="gemini-2.0-flash"')
    return params
