"""Entry identity: pure functions, no I/O.

An entry id is the digest of ``(kind, namespace, key)``. The same key in the
same namespace therefore always names the same entry, on every process and
every host (no per-process hash seeds), and a manifest can be checked against
its own file name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import InvalidIdError
from .digest import hash_parts, is_digest

KINDS: frozenset[str] = frozenset({"vllm", "pytorch", "mlx", "genai"})

_NAMESPACE_RE = re.compile(r"[\x21-\x7e]{1,512}")  # printable ASCII, no spaces
_OBJECT_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_PREFIX_RE = re.compile(r"[0-9a-f]{4,64}")
MAX_KEY_LEN = 1024
_TENANT_ID_RE = re.compile(r"[0-9a-f]{16}")


def validate_kind(kind: str) -> str:
    if kind not in KINDS:
        raise InvalidIdError(
            f"unknown entry kind {kind!r}", fix=f"use one of: {', '.join(sorted(KINDS))}"
        )
    return kind


def validate_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace):
        raise InvalidIdError(
            "invalid namespace", fix="use 1-512 printable ASCII characters without spaces"
        )
    return namespace


def validate_key(key: str) -> str:
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LEN or not key.isprintable():
        raise InvalidIdError("invalid entry key", fix=f"use 1-{MAX_KEY_LEN} printable characters")
    return key


def validate_object_name(name: str) -> str:
    if not isinstance(name, str) or not _OBJECT_NAME_RE.fullmatch(name):
        raise InvalidIdError(
            f"invalid object name {name!r}",
            fix="use 1-128 characters from [A-Za-z0-9._-], starting with a letter or digit",
        )
    return name


def entry_id_for(kind: str, namespace: str, key: str) -> str:
    """The entry id of ``key`` in ``namespace`` of ``kind`` (64 hex characters)."""
    validate_kind(kind)
    validate_namespace(namespace)
    validate_key(key)
    return hash_parts(b"spoolctl-entry/v1", kind.encode(), namespace.encode(), key.encode())


def validate_entry_id(entry_id: str) -> str:
    """Return ``entry_id`` if it is 64 lowercase hex characters, else raise InvalidIdError."""
    if not is_digest(entry_id):
        raise InvalidIdError(
            f"invalid entry id {str(entry_id)[:80]!r}",
            fix="pass the 64-character hex id shown by `spoolctl ls`",
        )
    return entry_id


def validate_entry_prefix(prefix: str) -> str:
    """Validate a user-typed id prefix (4-64 lowercase hex characters)."""
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        raise InvalidIdError(
            f"invalid entry id {str(prefix)[:80]!r}",
            fix="pass a hex entry id (at least 4 characters) as shown by `spoolctl ls`",
        )
    return prefix


@dataclass(frozen=True)
class TenantId:
    """A tenant of an encrypted store (``sealing``) given by its opaque id rather than its
    name, for an entry whose key the caller already named for it (``TenantNames.chunk_key``):
    the store seals the entry with the tenant's data key and keeps the key as given."""

    tid: str

    def __post_init__(self) -> None:
        if not isinstance(self.tid, str) or not _TENANT_ID_RE.fullmatch(self.tid):
            raise InvalidIdError("a tenant id is 16 lowercase hex characters",
                                 fix="pass TenantId.of(chunk key) or the tenant's name")

    @classmethod
    def of(cls, chunk_key: str) -> TenantId:
        """The tenant a ``TenantNames.chunk_key`` names."""
        return cls(chunk_key[:16])

    def __repr__(self) -> str:
        return f"TenantId({self.tid})"
