"""``generate_content`` with a context cache: the GenAI generate helpers.

Usable without a controller: ``generate_with_cache(client, params, handle, query)``
sends only what the cache lacks (per ``handle.includes``) plus the query, with
``cached_content=handle.ref``, and reports ``Usage.cache_read_tokens`` from the
server's ``cached_content_token_count``. A cache the server no longer has is a
``NotFoundError`` (so callers re-prepare); other failures are one-line SpoolErrors.

Imports google-genai, like ``genai.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from google import genai

from spoolctl.store import ConfigError, NotFoundError, SpoolError

from ..contract import CacheHandle, CachePrepareParams, Element, GenerateResult, Includes, Usage
from .io import TRANSPORT_ERRORS, Remote
from .records import generate_request, remote_error

Query = str | Element | Sequence[Element | str] | None


def with_max_tokens(config: Mapping[str, Any] | None,
                    max_new_tokens: int | None) -> dict[str, Any] | None:
    """``config`` with ``max_output_tokens`` set from ``max_new_tokens`` (if given)."""
    if max_new_tokens is None:
        return dict(config) if config is not None else None
    if max_new_tokens < 1:
        raise ConfigError("max_new_tokens must be >= 1", fix="ask for at least one token")
    return {**(config or {}), "max_output_tokens": max_new_tokens}


def _query_elements(query: Query) -> list[Element]:
    if query is None:
        return []
    if isinstance(query, (str, Element)):
        query = [query]
    query = [q for q in query if not (isinstance(q, str) and not q)]  # "" means no prompt
    return [Element.coerce(q) if not isinstance(q, str) else Element(q, role="user")
            for q in query]


def _generate_args(params: CachePrepareParams, handle: CacheHandle, query: Query,
                   config: Mapping[str, Any] | None) -> dict[str, Any]:
    includes = handle.includes if handle else Includes()
    contents, cfg = generate_request(params, includes, _query_elements(query), config,
                                     cached_content=handle.ref if handle else None)
    return {"model": params.model, "contents": contents, "config": cfg}


def _result(response: Any, handle: CacheHandle) -> GenerateResult:
    meta = response.usage_metadata
    usage = Usage(
        prompt_tokens=int(getattr(meta, "prompt_token_count", None) or 0),
        completion_tokens=int(getattr(meta, "candidates_token_count", None) or 0),
        cache_read_tokens=int(getattr(meta, "cached_content_token_count", None) or 0),
    )
    try:
        text = response.text or ""
    except ValueError:  # no text parts (e.g. only a function call)
        text = ""
    return GenerateResult(usage=usage, handle=handle, text=text, response=response)


def generate_with_cache(client: genai.Client, params: CachePrepareParams, handle: CacheHandle,
                        query: Query = None, *,
                        config: Mapping[str, Any] | None = None) -> GenerateResult:
    """``client.models.generate_content`` with ``cached_content=handle.ref``, sending only
    what the cache lacks (per ``handle.includes``) plus ``query``. Usage reports
    ``cache_read_tokens`` from ``usage_metadata.cached_content_token_count``."""
    args = _generate_args(params, handle, query, config)
    step = Remote("generate_content", args, "generating", params.require_model())
    try:
        response = client.models.generate_content(**args)
    except TRANSPORT_ERRORS as exc:
        raise _generate_error(exc, step, handle) from exc
    return _result(response, handle)


async def agenerate_with_cache(client: genai.Client, params: CachePrepareParams,
                               handle: CacheHandle,
                               query: Query = None, *,
                               config: Mapping[str, Any] | None = None) -> GenerateResult:
    args = _generate_args(params, handle, query, config)
    step = Remote("generate_content", args, "generating", params.require_model())
    try:
        response = await client.aio.models.generate_content(**args)
    except TRANSPORT_ERRORS as exc:
        raise _generate_error(exc, step, handle) from exc
    return _result(response, handle)


def _generate_error(exc: BaseException, step: Remote, handle: CacheHandle) -> SpoolError:
    # A missing cache in a generate call is a 403 "CachedContent not found" from the
    # service; report it as the miss it is so callers re-prepare.
    message = str(getattr(exc, "message", "") or "")
    if handle and getattr(exc, "code", None) in (403, 404) and "CachedContent" in message:
        err = NotFoundError(f"cached content {handle.ref} is gone on the server "
                            f"({getattr(exc, 'code', '')}: {' '.join(message.split())[:200]})",
                            fix="prepare() again to create a new cache")
        err.code = getattr(exc, "code", None)
        return err
    return remote_error(exc, step.action, step.where)
