"""The I/O drivers of the GenAI controller: one logic, run sync or async.

The controller's logic is written once, as generators (``Step``) that yield the I/O
they need: ``Remote`` (one ``client.caches`` call) and ``Local`` (one store call).
``drive_sync`` runs them on ``client.caches`` in the calling thread; ``drive_async``
on ``client.aio.caches``, with store calls in a worker thread. A
failure of either comes back into the generator as a SpoolError (server and
transport errors via ``records.remote_error``), so it can react in one place.

Imports google-genai (its error types), like ``genai.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from google import genai
from google.genai import errors as genai_errors

from spoolctl.store import SpoolError

from .records import GenaiTarget, remote_error

TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (genai_errors.APIError, OSError)
try:  # the SDK's transports; their errors are "service unavailable", not bugs
    import httpx

    TRANSPORT_ERRORS += (httpx.HTTPError,)
except ImportError:  # pragma: no cover
    pass
try:
    import aiohttp

    TRANSPORT_ERRORS += (aiohttp.ClientError,)
except ImportError:  # pragma: no cover
    pass


def target_of(client: genai.Client) -> GenaiTarget:
    """The API shape a client talks to (Gemini API or a Vertex AI project/location)."""
    api = client._api_client  # the SDK exposes these facts only on its api client
    base = api._http_options.base_url or None
    if base is not None and (urlsplit(base).hostname or "").endswith("googleapis.com"):
        base = None  # Google's own endpoint: derived again from api/project/location
    version = api._http_options.api_version
    if api.vertexai:
        return GenaiTarget("vertex", project=api.project, location=api.location,
                           base_url=base, api_version=version)
    return GenaiTarget("gemini", base_url=base, api_version=version)


@dataclass(frozen=True)
class Remote:
    """One ``caches`` call: ``op`` in create/get/update/delete."""

    op: str
    kwargs: Mapping[str, Any]
    action: str
    where: str


@dataclass(frozen=True)
class Local:
    """One store call (run in a worker thread under asyncio)."""

    fn: Callable[[], Any]


Step = Generator[Remote | Local, Any, Any]


def iter_one(step: Remote) -> Step:
    """A one-step program: the result of ``step``."""
    return (yield step)


def call(fn: Callable[..., Any], step: Remote) -> Any:
    try:
        return fn(**step.kwargs)
    except TRANSPORT_ERRORS as exc:
        raise remote_error(exc, step.action, step.where) from exc


async def acall(fn: Callable[..., Any], step: Remote) -> Any:
    try:
        return await fn(**step.kwargs)
    except TRANSPORT_ERRORS as exc:
        raise remote_error(exc, step.action, step.where) from exc


class _Program:
    """A ``Step`` generator being driven: feed it each outcome, get its next step (None
    once it has returned; its value is then ``result``)."""

    def __init__(self, steps: Step):
        self._steps = steps
        self.result: Any = None

    def next(self, value: Any = None, error: BaseException | None = None
             ) -> Remote | Local | None:
        try:
            return self._steps.throw(error) if error is not None else self._steps.send(value)
        except StopIteration as stop:
            self.result = stop.value
            return None


def drive_sync(client: genai.Client, steps: Step) -> Any:
    """Run ``steps`` to completion on ``client.caches``; returns the generator's value."""
    program = _Program(steps)
    step = program.next()
    while step is not None:
        try:
            if isinstance(step, Local):
                value = step.fn()
            else:
                value = call(getattr(client.caches, step.op), step)
        except SpoolError as exc:
            step = program.next(error=exc)
        else:
            step = program.next(value)
    return program.result


async def drive_async(client: genai.Client, steps: Step) -> Any:
    """``drive_sync`` on ``client.aio.caches``, store calls in a worker thread."""
    program = _Program(steps)
    step = program.next()
    while step is not None:
        try:
            if isinstance(step, Local):
                value = await asyncio.to_thread(step.fn)
            else:
                value = await acall(getattr(client.aio.caches, step.op), step)
        except SpoolError as exc:
            step = program.next(error=exc)
        else:
            step = program.next(value)
    return program.result
