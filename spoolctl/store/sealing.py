"""Encryption at rest with per-tenant keys: tenant names and ids, the store's ``Sealer`` and
the tenant policy of a commit. The master key is in ``master_key``, the keyring of wrapped
data keys in ``keyring``, the object format in ``sealed_objects``; their names are
re-exported here, the one import for the store's users.

* ``Sealer.seal`` returns ``HEADER | ciphertext | tag`` for one payload, bound to its entry
  and name; ``Sealer.open`` decrypts one object in one pass against the reader's binding
  (``read_binding``), raising ``KeyUnavailableError`` (a miss, nothing quarantined) when the
  key is gone or the entry predates binding, and ``CorruptionError`` otherwise.
* Tenant names are never stored: ``tenant_id`` is an opaque 16-hex id derived with the master
  key; a tenant's entry keys are replaced by a keyed hash (``sealed_key``), so equal prompts
  of two tenants give unrelated entry ids.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import blake3

from ..errors import ConfigError, CorruptionError, KeyUnavailableError, QuarantineReason
from . import sealed_objects
from .commit.committer import PutRequest
from .format.keys import TenantId, entry_id_for
from .format.manifest import Manifest
from .keyring import (
    KEYRING_SCHEMA,
    TID_RE,
    KeyAdoption,
    Keyring,
    KeyTable,
    TenantKeys,
    check_key_table,
    new_version,
    read_key_table,
    valid_version,
)
from .master_key import COMMAND_ENV, COMMAND_TIMEOUT, FILE_ENV, VALUE_ENV, MasterKey
from .sealed_objects import (
    BOUND_HEADER_BYTES,
    HEADER_BYTES,
    MAGIC,
    MAGIC2,
    MAGIC3,
    NONCE_BYTES,
    OVERHEAD,
    SEAL_CHUNK,
    TAG_BYTES,
    WIDE_VERSION,
    Binding,
    BytesLike,
    LegacySealError,
    SealedStream,
    legacy_refusal,
)

__all__ = [
    "BOUND_HEADER_BYTES", "COMMAND_ENV", "COMMAND_TIMEOUT", "DEFAULT_TENANT", "FILE_ENV",
    "HEADER_BYTES", "INDEX_FIELD", "KEYRING_SCHEMA", "MAGIC", "MAGIC2", "MAGIC3",
    "NONCE_BYTES", "OVERHEAD", "SEAL_CHUNK", "TAG_BYTES", "VALUE_ENV", "WIDE_VERSION",
    "Binding", "BytesLike", "KeyAdoption", "KeyTable", "Keyring", "LegacySealError",
    "MasterKey", "SealedStream", "Sealer", "TenantId", "TenantKeys", "TenantNames",
    "check_key_table", "key_tenant", "legacy_refusal", "new_version", "open_sealer",
    "overhead", "plain_size", "read_binding", "read_key_table", "refuse_encrypted",
    "seal_request", "sealed_fact", "stored_key", "tenant_of",
]

DEFAULT_TENANT = "default"
INDEX_FIELD = "sealed"  # the manifest index fact: {"tenant": tid, "version": n, "bound": true}
# Naming keys kept per process (one per tenant seen; recomputed after the cache is cleared).
_NAME_KEYS_KEPT = 4096


class TenantNames:
    """Tenant ids and entry names, from the master key alone (no keyring): all a process that
    only names entries needs (the vLLM scheduler, which plans against rank stores it may not
    open). See the module docstring."""

    def __init__(self, master: MasterKey):
        self.master = master
        self._tid_key = master.derive(b"tenant-id")
        self._names: dict[str, bytes] = {}

    def tenant_id(self, tenant: str | None) -> str:
        """The opaque id of tenant ``tenant`` (None: the default tenant)."""
        name = DEFAULT_TENANT if tenant is None else tenant
        if not isinstance(name, str) or not name or len(name) > 1024:
            raise ConfigError("a tenant is a non-empty name of at most 1024 characters",
                              fix="pass the tenant's name (vLLM: its cache_salt)")
        return blake3.blake3(name.encode(), key=self._tid_key).hexdigest()[:16]

    def _name_key(self, tid: str) -> bytes:
        nk = self._names.get(tid)
        if nk is None:
            if len(self._names) >= _NAME_KEYS_KEPT:  # one per tenant seen: bounded
                self._names.clear()
            nk = self._names[tid] = self.master.derive(b"entry-names " + tid.encode())
        return nk

    def sealed_key(self, tenant: str | None, key: str) -> str:
        """The key an entry of ``tenant`` is stored under: unlinkable across tenants."""
        tid = self.tenant_id(tenant)
        return f"t:{tid}:" + blake3.blake3(key.encode(), key=self._name_key(tid)).hexdigest()

    def chunk_key(self, tenant: str | None, key: str) -> str:
        """``key`` of ``tenant`` as 64 hex characters (32 bytes) that name their tenant: its
        id (16 hex) then 48 hex of ``key`` hashed under the tenant's naming key. For callers
        whose keys must stay 32 raw bytes (the vLLM connector's chunk keys travel in its
        inventory reports); an entry committed under it with ``tenant=TenantId.of(chunk
        key)`` keeps this key and is sealed with that tenant's data key."""
        tid = self.tenant_id(tenant)
        return tid + blake3.blake3(key.encode(), key=self._name_key(tid)).hexdigest()[:48]


class Sealer(TenantNames):
    """One store's encryption: the master key and its keyring (see the module docstring).
    ``on_bound``: called once, before this sealer first seals an object (the store makes
    its marker require bound objects there, so an older spoolctl refuses the store)."""

    def __init__(self, master: MasterKey, keyring: Keyring,
                 on_bound: Callable[[], Any] | None = None):
        super().__init__(master)
        self.keyring = keyring
        self._lib = master._lib
        self._on_bound = on_bound

    def before_sealing(self) -> None:
        """Run ``on_bound`` once per sealer."""
        if self._on_bound is not None:
            self._on_bound()
            self._on_bound = None

    def key_available(self, manifest: Manifest) -> bool:
        """False when ``manifest`` is sealed under a key the keyring no longer holds (revoked,
        retired, erased, or another master key) or in the format before objects were bound
        (never opened); True for a sealed entry it can open and a plain one."""
        fact = sealed_fact(manifest.index)
        if fact is None:
            return True
        return _bound(manifest.index) and self.keyring.data_key(*fact) is not None

    def _key_of(self, binding: Binding) -> bytes:
        key = self.keyring.data_key(binding.tid, binding.version)
        if key is None:
            raise KeyUnavailableError(
                f"the key of tenant {binding.tid} version {binding.version} is not available "
                "(revoked, retired, or another master key)",
                fix="nothing to do for a revoked tenant: it is a miss; otherwise check the "
                    "master key (`spoolctl doctor`)", erased=self.keyring.master_matches)
        return key

    def seal(self, binding: Binding, key: bytes, payload: BytesLike) -> memoryview:
        """``payload`` sealed under ``key`` (``keyring.current`` of ``binding.tid``), bound to
        ``binding``, in one buffer."""
        return sealed_objects.seal(self._lib, key, binding, payload)

    def seal_stream(self, binding: Binding, key: bytes, payload: BytesLike) -> SealedStream:
        """``payload`` sealed like ``seal``, as a stream the commit writes chunk by chunk
        (``SealedStream``): the same bytes on disk (one GCM stream)."""
        return SealedStream(self._lib, key, binding, payload)

    def open(self, path: Path, size: int, into: memoryview | None = None, *,
             binding: Binding) -> memoryview:
        """Read the sealed object at ``path`` (``size`` bytes), which must be bound to
        ``binding`` (built by the reader from the entry it asked for: ``read_binding``), and
        return its plaintext.

        One pass: chunks are read and decrypted as they arrive (an object larger than
        ``verify.INLINE_HASH_MAX`` decrypts chunk i on a helper thread while chunk i+1 is
        read), straight into the returned buffer; the tag, checked at the end,
        authenticates every byte and the binding, and on a failure the buffer is wiped
        before the error. FileNotFoundError if missing; KeyUnavailableError when its key is
        gone (before the body is read); CorruptionError on a bad size or tag, a header of
        another tenant, key or format, or a file that is not regular."""
        return sealed_objects.open_file(self._lib, self._key_of, path, size, binding, into)

    def unseal(self, sealed: memoryview, into: memoryview | None = None, *,
               binding: Binding, path: Path | None = None) -> memoryview:
        """The plaintext of the sealed bytes ``sealed`` (see ``open``)."""
        return sealed_objects.unseal(self._lib, self._key_of, sealed, binding, into, path)


def open_sealer(state: Path, tmp: Path, *, lock_timeout: float, read_only: bool,
                master: MasterKey | None, on_wide: Callable[[], Any] | None = None,
                on_bound: Callable[[], Any] | None = None) -> Sealer | None:
    """The store's sealer for ``master`` (None: encryption off); ``on_wide``: see
    ``Keyring``; ``on_bound``: see ``Sealer``."""
    if master is None:
        return None
    return Sealer(master, Keyring(state, tmp, master, lock_timeout=lock_timeout,
                                  read_only=read_only, on_wide=on_wide), on_bound)


def sealed_fact(index: Mapping[str, Any] | None) -> tuple[str, int] | None:
    """``(tenant id, version)`` of an entry whose manifest index says it is sealed."""
    fact = (index or {}).get(INDEX_FIELD)
    if isinstance(fact, Mapping) and isinstance(fact.get("tenant"), str) and \
            TID_RE.fullmatch(fact["tenant"]) and valid_version(fact.get("version")):
        return fact["tenant"], fact["version"]
    return None


def _bound(index: Mapping[str, Any] | None) -> bool:
    """Whether a sealed entry's objects are bound to it (SPS3): its fact says so."""
    fact = (index or {}).get(INDEX_FIELD)
    return isinstance(fact, Mapping) and fact.get("bound") is True


def plain_size(manifest: Manifest, name: str) -> int:
    """The bytes object ``name`` of ``manifest`` reads back as (``Store.read``): its size on
    disk, less the header and tag of a sealed object. KeyError if there is no such object."""
    size = manifest.object(name).size
    fact = sealed_fact(manifest.index)
    return size if fact is None else size - overhead(fact[1], bound=_bound(manifest.index))


def overhead(version: int, *, bound: bool = True) -> int:
    """Bytes a sealed object adds to its payload (header and tag): the SPS3 header of every
    object sealed now; ``bound=False``, an older object under key ``version`` (SPS1 for
    the per-keyring counters of old stores, SPS2 for random key ids)."""
    if bound:
        return OVERHEAD
    return (HEADER_BYTES if version < WIDE_VERSION else BOUND_HEADER_BYTES) + TAG_BYTES


def key_tenant(key: str) -> str | None:
    """The tenant id an entry's stored key names (``sealed_key``: ``t:<id>:...``;
    ``chunk_key``: ``<id>...``), None when it names none."""
    if key.startswith("t:"):
        tid = key[2:18]
        return tid if key[18:19] == ":" and TID_RE.fullmatch(tid) else None
    return key[:16] if TID_RE.fullmatch(key[:16]) else None


def read_binding(manifest: Manifest, name: str) -> Binding:
    """The binding object ``name`` of the sealed entry ``manifest`` must carry, from the
    entry the reader asked for: its id (which the reader derived from the tenant and key
    it asked with) and the tenant its key names -- never from the object's bytes.
    CorruptionError when the manifest's sealed fact names another tenant than its key;
    LegacySealError (a miss) for an entry sealed before objects were bound."""
    fact = sealed_fact(manifest.index)
    assert fact is not None, "read_binding is for sealed entries"
    tid, version = fact
    if key_tenant(manifest.key) != tid:
        raise CorruptionError("a sealed entry names another tenant than its key",
                              reason=QuarantineReason.MANIFEST_VALIDATION)
    if not _bound(manifest.index):
        raise legacy_refusal(None)
    return Binding(manifest.entry_id, name, tid, version)


def seal_request(sealer: Sealer | None, request: PutRequest) -> PutRequest:
    """``request`` as the store commits it: with a sealer, its objects sealed under the
    tenant's current key, each bound to the entry and its name (``Binding``), its key
    replaced by ``sealed_key`` (kept for a ``TenantId``: ``stored_key``) and the ``sealed``
    fact in its index; without one, unchanged (a ``tenant`` then is a ConfigError: it would
    not isolate anything). A streamed payload is gathered first (AES-GCM seals one
    buffer)."""
    if sealer is None:
        if request.tenant is not None:
            raise ConfigError("a tenant was given but the store has no encryption configured",
                              fix=f"set {FILE_ENV} (or {VALUE_ENV} / {COMMAND_ENV}), or drop "
                                  "the tenant")
        return request
    tid = tenant_of(sealer, request.tenant, request.key)
    key_name = stored_key(sealer, request.tenant, request.key)
    entry_id = entry_id_for(request.kind, request.namespace, key_name)
    version, key = sealer.keyring.current(tid)
    sealer.before_sealing()
    objects: dict[str, SealedStream] = {}
    for name, payload in request.objects.items():
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            payload = b"".join(payload)  # the tag covers all of it: gathered, then streamed
        objects[name] = sealer.seal_stream(Binding(entry_id, name, tid, version), key, payload)
    index = dict(request.index or {})
    index[INDEX_FIELD] = {"tenant": tid, "version": version, "bound": True}
    return replace(request, key=key_name, objects=objects, index=index, tenant=None)


def tenant_of(names: TenantNames, tenant: str | TenantId | None, key: str) -> str:
    """The id of ``tenant``; for a ``TenantId``, ConfigError unless ``key`` names it."""
    if isinstance(tenant, TenantId):
        if not key.startswith(tenant.tid):
            raise ConfigError("an entry key named for another tenant",
                              fix="name it with TenantNames.chunk_key for this tenant")
        return tenant.tid
    return names.tenant_id(tenant)


def stored_key(names: TenantNames, tenant: str | TenantId | None, key: str) -> str:
    """The key an entry of ``tenant`` is stored under: ``sealed_key`` for a tenant's name,
    ``key`` itself for a ``TenantId`` (the caller named it: ``chunk_key``)."""
    tenant_of(names, tenant, key)
    return key if isinstance(tenant, TenantId) else names.sealed_key(tenant, key)


def refuse_encrypted(store: Any, consumer: str) -> None:
    """ConfigError if ``store`` is encrypted: ``consumer`` does not pass tenants yet, and its
    own entry ids would never match the tenant-keyed names (every lookup a miss). Fail closed
    and say so rather than write entries that are never found."""
    if getattr(store, "sealer", None) is not None:
        raise ConfigError(f"{consumer} does not support encryption at rest yet",
                          path=getattr(store, "root", None),
                          fix=f"unset {FILE_ENV}/{VALUE_ENV}/{COMMAND_ENV} for this process, "
                              "or use a store without encryption")
