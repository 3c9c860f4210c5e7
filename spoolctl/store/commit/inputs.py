"""Checking what a client hands to ``Store.put`` before the first byte is written (pure).

A put with a bad argument must fail with the store's own error (ConfigError /
InvalidIdError, one line with a fix) before any object is published: not a plain
ValueError or TypeError from deep inside the commit, after objects already sit on disk
as orphans. ``check_put`` validates ids, the object map, each payload's type, ``meta``
and ``index`` (JSON values, finite numbers, the facts the store interprets, the
manifest size bound) and ``supersedes``. The chunks of a streaming payload can only be
checked as they arrive: the commit stages every object before publishing any, so a bad
chunk still leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeGuard

from ...errors import ConfigError, InvalidIdError
from ..catalog.rows import index_problem
from ..format.keys import TenantId, entry_id_for, validate_entry_id, validate_object_name
from ..format.manifest import MAX_DEPTH, MAX_MANIFEST_BYTES, MAX_OBJECTS, canonical_json

BytesLike = bytes | bytearray | memoryview


def is_bytes_like(value: Any) -> TypeGuard[bytes | bytearray | memoryview]:
    return isinstance(value, (bytes, bytearray, memoryview))


def known_size(value: Any) -> int | None:
    """Bytes of a payload known before it is written: a bytes-like payload, or a sized
    source marked ``replayable`` (``sealing.SealedStream``); None for a streamed one (an
    iterator: sized only as it streams, read once)."""
    if is_bytes_like(value):
        return payload_size(value)
    size = getattr(value, "size", None)
    return size if isinstance(size, int) and getattr(value, "replayable", False) else None


def payload_size(value: BytesLike) -> int:
    """Bytes of a bytes-like payload; ConfigError for a buffer spoolctl cannot write as is."""
    view = memoryview(value)
    if not view.c_contiguous:
        raise ConfigError("a payload buffer must be C-contiguous",
                          fix="pass bytes(...) or a contiguous copy")
    return view.nbytes


def check_put(*, kind: str, namespace: str, key: str, objects: Any, meta: Any, index: Any,
              supersedes: Any, tenant: Any = None) -> str:
    """Validate the arguments of ``Store.put``; return the entry id.

    Raises InvalidIdError / ConfigError naming what is wrong and how to fix it."""
    entry_id = entry_id_for(kind, namespace, key)
    if tenant is not None and (not isinstance(tenant, str) or not tenant) and \
            not isinstance(tenant, TenantId):  # validated when made
        raise ConfigError("tenant must be a non-empty string", fix="pass the tenant's name")
    if not isinstance(objects, Mapping):
        raise ConfigError("objects must be a mapping of object name to payload",
                          fix='pass e.g. objects={"kv": data}')
    if len(objects) > MAX_OBJECTS:
        raise ConfigError(f"an entry holds at most {MAX_OBJECTS} objects, got {len(objects)}",
                          fix="pack small payloads into fewer objects")
    for name, payload in objects.items():
        validate_object_name(name)
        if is_bytes_like(payload):
            payload_size(payload)
        elif isinstance(payload, (str, Mapping)) or not isinstance(payload, Iterable):
            raise ConfigError(
                f"payload of object {name} is a {type(payload).__name__}",
                fix="pass bytes, bytearray, memoryview, or an iterable of them (streamed)")
    encoded = 0
    for label, value in (("meta", meta), ("index", index)):
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise ConfigError(f"{label} must be a mapping (a JSON object)",
                              fix=f"pass a dict of JSON values as {label}")
        problem = json_problem(value, 0)
        if problem is not None:
            raise ConfigError(f"{label} is not valid JSON data: {problem}",
                              fix="use strings, finite numbers, booleans, None, lists and "
                                  "dicts with string keys")
        encoded += len(canonical_json(dict(value)))
    if isinstance(index, Mapping):
        problem = index_problem(index)
        if problem is not None:
            raise ConfigError(problem, fix="expire_time is unix seconds; remote_pending a bool")
    if encoded > MAX_MANIFEST_BYTES // 2:
        raise ConfigError(f"meta and index take {encoded} bytes, over the "
                          f"{MAX_MANIFEST_BYTES // 2} byte limit",
                          fix="keep large data in payload objects, not in meta")
    if supersedes is not None:
        if not isinstance(supersedes, str):
            raise InvalidIdError("supersedes must be an entry id", fix="pass manifest.entry_id")
        validate_entry_id(supersedes)
        if supersedes == entry_id:
            raise ConfigError("an entry cannot supersede itself",
                              fix="pass the id of the entry this one replaces")
    return entry_id


def json_problem(value: Any, depth: int) -> str | None:
    """Why ``value`` is not plain JSON data (None if it is)."""
    if depth > MAX_DEPTH:
        return "nested too deeply"
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"key {k!r} is not a string"
            problem = json_problem(v, depth + 1)
            if problem:
                return problem
        return None
    if isinstance(value, (list, tuple)):
        for v in value:
            problem = json_problem(v, depth + 1)
            if problem:
                return problem
        return None
    if isinstance(value, float):
        return None if value == value and value not in (float("inf"), float("-inf")) \
            else "a number is not finite"
    if value is None or isinstance(value, (str, int, bool)):
        return None
    return f"a value of type {type(value).__name__}"
