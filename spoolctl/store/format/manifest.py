"""Manifests: the immutable description of one entry (pure encode/decode/validate).

On disk a manifest is a JSON envelope::

    {"schema": "spoolctl-manifest/v1",
     "digest": "<blake3 hex of the canonical JSON of body>",
     "tag": {"alg", "key_id", "mac"},        # optional: keyed MAC of "digest" (entry_tags)
     "body": {"entry_id", "kind", "namespace", "key", "created",
              "objects": [{"name", "digest", "size"}],
              "meta": {...}, "index": {...}, "supersedes": null | "<entry id>"}}

``meta`` is the consumer's description of the payload (layout, token ids...),
``index`` the small facts the catalog indexes for selection (element hashes...).
Decoding checks the envelope digest, every field, and that ``entry_id`` is the
id of ``(kind, namespace, key)``, so a manifest copied or swapped onto another
entry's file name is rejected. ``tag`` is written only when the committing store has a
tag key (``entry_tags``); decoding checks its shape, ``Store.manifest`` its value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import ManifestError, QuarantineReason, SpoolError
from . import manifest_fast
from .digest import hash_bytes, is_digest
from .entry_tags import TagKey, check_tag_field
from .keys import (
    entry_id_for,
    validate_entry_id,
    validate_object_name,
)

SCHEMA = "spoolctl-manifest/v1"
MAX_MANIFEST_BYTES = 16 << 20
MAX_OBJECTS = 4096
MAX_OBJECT_SIZE = 1 << 44
MAX_DEPTH = 32


@dataclass(frozen=True)
class ObjectRef:
    """One payload object of an entry: its role name, digest and exact size."""

    name: str
    digest: str
    size: int

    def __post_init__(self) -> None:
        validate_object_name(self.name)
        if not is_digest(self.digest):
            raise ValueError("object digest must be 64 lowercase hex characters")
        if not isinstance(self.size, int) or isinstance(self.size, bool):
            raise ValueError("object size must be an integer")
        if not 0 <= self.size <= MAX_OBJECT_SIZE:
            raise ValueError("object size out of range")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "digest": self.digest, "size": self.size}


@dataclass(frozen=True)
class Manifest:
    """A validated manifest body. Construct via ``Manifest.new`` or ``decode``."""

    entry_id: str
    kind: str
    namespace: str
    key: str
    created: float
    objects: tuple[ObjectRef, ...]
    meta: Mapping[str, Any] = field(default_factory=dict)
    index: Mapping[str, Any] = field(default_factory=dict)
    supersedes: str | None = None
    # Envelope facts, not body: the authentication tag as read, and the envelope digest it
    # was verified against (None for a manifest built in this process).
    tag: Mapping[str, str] | None = field(default=None, compare=False, repr=False)
    digest: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        expected = entry_id_for(self.kind, self.namespace, self.key)  # checks all three
        validate_entry_id(self.entry_id)
        if self.entry_id != expected:
            raise ValueError("entry_id does not match kind/namespace/key")
        if not isinstance(self.created, (int, float)) or not math.isfinite(self.created):
            raise ValueError("created must be a finite number")
        if len(self.objects) > MAX_OBJECTS:
            raise ValueError("too many objects")
        names = [o.name for o in self.objects]
        if len(set(names)) != len(names):
            raise ValueError("duplicate object names")
        if self.supersedes is not None:
            validate_entry_id(self.supersedes)
            if self.supersedes == self.entry_id:
                raise ValueError("an entry cannot supersede itself")
        for label, value in (("meta", self.meta), ("index", self.index)):
            if type(value) is not dict and not isinstance(value, Mapping):
                raise ValueError(f"{label} must be an object")
            _check_json_value(value, 0)

    @classmethod
    def new(
        cls,
        *,
        kind: str,
        namespace: str,
        key: str,
        created: float,
        objects: tuple[ObjectRef, ...],
        meta: Mapping[str, Any] | None = None,
        index: Mapping[str, Any] | None = None,
        supersedes: str | None = None,
    ) -> Manifest:
        return cls(
            entry_id=entry_id_for(kind, namespace, key),
            kind=kind,
            namespace=namespace,
            key=key,
            created=created,
            objects=objects,
            meta=dict(meta or {}),
            index=dict(index or {}),
            supersedes=supersedes,
        )

    @property
    def payload_bytes(self) -> int:
        return sum(o.size for o in self.objects)

    def object(self, name: str) -> ObjectRef:
        for ref in self.objects:
            if ref.name == name:
                return ref
        raise KeyError(name)

    def body(self) -> dict[str, Any]:
        return {
            "entry_id": self.entry_id,
            "kind": self.kind,
            "namespace": self.namespace,
            "key": self.key,
            "created": self.created,
            "objects": [o.to_json() for o in self.objects],
            "meta": dict(self.meta),
            "index": dict(self.index),
            "supersedes": self.supersedes,
        }


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON bytes (sorted keys, no whitespace, no NaN)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def envelope_digest(manifest: Manifest) -> str:
    """The digest of the manifest's body (what its envelope records and its tag covers)."""
    return manifest.digest or hash_bytes(canonical_json(manifest.body()))


def encode(manifest: Manifest, tag_key: TagKey | None = None) -> bytes:
    """Serialise a manifest into its on-disk envelope.

    With ``tag_key`` the envelope gets a fresh tag; without, a tag read with the manifest
    is kept when it was made for this very body (an export carries its tags), else none."""
    body = manifest.body()
    digest = hash_bytes(canonical_json(body))
    envelope: dict[str, Any] = {"schema": SCHEMA, "digest": digest, "body": body}
    if tag_key is not None:
        envelope["tag"] = tag_key.tag(digest)
    elif manifest.tag is not None and manifest.digest == digest:
        envelope["tag"] = dict(manifest.tag)
    data = json.dumps(
        envelope,
        sort_keys=True,
        separators=(",", ":"),
        allow_nan=False,
    ).encode()
    if len(data) > MAX_MANIFEST_BYTES:
        raise SpoolError(
            f"manifest is {len(data)} bytes, over the {MAX_MANIFEST_BYTES} byte limit",
            fix="keep large data in payload objects, not in meta",
        )
    return data


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name} in JSON")


def _check_json_value(value: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueError("JSON nested too deeply")
    # ``type(...) is dict`` first: what decoding gives, without the ABC check's cost (a
    # rebuild checks every manifest's meta and index).
    if type(value) is dict or isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError("JSON object keys must be strings")
            _check_json_value(v, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_json_value(v, depth + 1)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("non-finite number in JSON")
    elif value is not None and not isinstance(value, (str, int, bool)):
        raise ValueError(f"unsupported JSON value of type {type(value).__name__}")


def decode(
    data: bytes, *, expected_entry_id: str | None = None, path: str | None = None
) -> Manifest:
    """Parse and validate an on-disk manifest; raise ManifestError on any defect."""

    def bad(why: str) -> ManifestError:
        return ManifestError(
            f"invalid manifest: {why}",
            reason=QuarantineReason.MANIFEST_VALIDATION,
            path=path,
            fix="the entry is quarantined and treated as a miss; nothing to do",
            entry_id=expected_entry_id,
        )

    if len(data) > MAX_MANIFEST_BYTES:
        raise bad("file too large")
    env = manifest_fast.parse(data, SCHEMA)
    if env is not None:  # what spoolctl writes: parsed and digest-checked in C
        manifest = _from_fast(env)
        if manifest is not None:
            if expected_entry_id is not None and manifest.entry_id != expected_entry_id:
                raise bad("entry id does not match the file name")
            return manifest
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"not valid JSON ({type(exc).__name__})") from None
    if not isinstance(doc, dict) or set(doc) - {"tag"} != {"schema", "digest", "body"}:
        raise bad("not a manifest envelope")
    if doc["schema"] != SCHEMA:
        raise bad(f"unsupported schema {str(doc['schema'])[:40]!r}")
    body = doc["body"]
    if not isinstance(body, dict):
        raise bad("body is not an object")
    try:
        if doc["digest"] != hash_bytes(canonical_json(body)):
            raise bad("envelope digest mismatch")
        expected = {
            "entry_id", "kind", "namespace", "key", "created", "objects", "meta", "index",
            "supersedes",
        }
        if set(body) != expected:
            raise bad("unexpected or missing fields")
        raw_objects = body["objects"]
        if not isinstance(raw_objects, list) or len(raw_objects) > MAX_OBJECTS:
            raise bad("objects is not a list")
        objects = []
        for raw in raw_objects:
            if not isinstance(raw, dict) or set(raw) != {"name", "digest", "size"}:
                raise bad("malformed object reference")
            objects.append(ObjectRef(name=raw["name"], digest=raw["digest"], size=raw["size"]))
        manifest = Manifest(
            entry_id=body["entry_id"],
            kind=body["kind"],
            namespace=body["namespace"],
            key=body["key"],
            created=body["created"],
            objects=tuple(objects),
            meta=body["meta"],
            index=body["index"],
            supersedes=body["supersedes"],
            tag=check_tag_field(doc["tag"]) if "tag" in doc else None,
            digest=doc["digest"],
        )
    except ManifestError:
        raise
    except (ValueError, TypeError, SpoolError, RecursionError) as exc:
        raise bad(str(exc)[:200]) from None
    if expected_entry_id is not None and manifest.entry_id != expected_entry_id:
        raise bad("entry id does not match the file name")
    return manifest


def authenticate(tag_key: TagKey, manifest: Manifest, path: Path) -> None:
    """ManifestError (``auth_tag``) unless ``manifest``'s tag is valid under ``tag_key``;
    the one check every reader of a manifest and the commit use."""
    problem = tag_key.problem(manifest.tag, envelope_digest(manifest))
    if problem is not None:
        raise ManifestError(
            f"entry {manifest.entry_id} is not authenticated: {problem}",
            reason=QuarantineReason.AUTH_TAG, path=path, entry_id=manifest.entry_id,
            fix="the entry was quarantined and is a miss; expected once for entries "
                "written before this key, otherwise find who wrote the store")


def _from_fast(env: Any) -> Manifest | None:
    """The ``Manifest`` of an envelope ``manifest_fast.parse`` vouched for, built (and so
    checked) by the same constructor as below; None if a check fails, so that the reference
    path in ``decode`` rejects it with its own message."""
    body = env.body
    try:
        return Manifest(
            entry_id=body.entry_id, kind=body.kind, namespace=body.namespace, key=body.key,
            created=body.created,
            objects=tuple(ObjectRef(o.name, o.digest, o.size) for o in body.objects),
            meta=body.meta, index=body.index, supersedes=body.supersedes,
            tag=None if env.tag is manifest_fast.UNSET else check_tag_field(env.tag),
            digest=env.digest,
        )
    except (ValueError, TypeError, SpoolError, RecursionError):
        return None
