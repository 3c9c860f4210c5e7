"""The fast path of manifest decoding: msgspec parses and shape-checks the envelope in C.

``manifest.decode`` (stdlib ``json``) is the reference. Contract: when ``parse(data)``
returns an envelope, the reference decoder would have parsed the same values and found the
same digest valid; otherwise it returns None and the caller runs the reference decoder.
The two agree because the fast path accepts only documents where msgspec's canonical
encoding is byte-for-byte Python's ``canonical_json``:

* the file is ASCII (Python's encoder writes ``ensure_ascii``; anything else goes slow);
* the re-encoded body is ASCII without DEL (msgspec writes non-ASCII and DEL raw, Python
  escapes them);
* every float is 0 or in [1e-4, 1e16), where both write the same shortest digits without an
  exponent (outside it Python writes ``1e+16``, msgspec ``1e16``);
* integers beyond 64 bits, lone surrogates, NaN literals: msgspec refuses them, so they go
  slow too.

``tests/test_manifest_fast.py`` checks the agreement. Without msgspec ``parse`` always
returns None and decoding is only slower.
"""

from __future__ import annotations

import re
from typing import Any

from .digest import hash_bytes

try:
    import msgspec
except ImportError:  # declared, but an old environment may lack it: the slow path only
    msgspec = None  # type: ignore[assignment]  # an optional module: None when missing

# Bytes that make the re-encoded body differ from Python's ensure_ascii canonical JSON.
_NOT_CANONICAL = re.compile(rb"[\x7f-\xff]")


def _plain_float(text: str) -> float:
    """A float literal in meta/index/tag, refused unless both encoders write it alike."""
    value = float(text)
    if value != 0 and not 1e-4 <= abs(value) < 1e16:
        raise ValueError("float outside the range both encoders write alike")
    return value


if msgspec is not None:
    class _Object(msgspec.Struct, forbid_unknown_fields=True):
        name: str
        digest: str
        size: int

    class _Body(msgspec.Struct, forbid_unknown_fields=True):
        entry_id: str
        kind: str
        namespace: str
        key: str
        created: int | float
        objects: list[_Object]
        meta: dict[str, Any]
        index: dict[str, Any]
        supersedes: str | None

    class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
        body: _Body
        digest: str
        schema: str
        tag: Any = msgspec.UNSET

    _DECODER = msgspec.json.Decoder(_Envelope, float_hook=_plain_float)
    _ENCODE = msgspec.json.Encoder(order="sorted").encode


def parse(data: bytes, schema: str) -> Any:
    """The envelope of ``data`` (``.body`` with ``.objects``, ``.digest``, ``.tag``, which is
    ``UNSET`` when absent) if msgspec's canonical encoding of its body is Python's and hashes
    to its digest; else None. None is not a verdict, only "ask the reference decoder"; the
    caller still builds the ``Manifest`` (every field check). Never raises."""
    if msgspec is None or not data.isascii():
        return None
    try:
        env = _DECODER.decode(data)
        created = env.body.created
        if env.schema != schema or (isinstance(created, float) and created != 0
                                    and not 1e-4 <= abs(created) < 1e16):
            return None
        canonical = _ENCODE(env.body)
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError):
        return None
    if _NOT_CANONICAL.search(canonical) or hash_bytes(canonical) != env.digest:
        return None
    return env


UNSET = msgspec.UNSET if msgspec is not None else object()
