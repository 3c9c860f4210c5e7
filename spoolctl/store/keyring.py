"""The store's keyring (``state/keyring.json``): one random data key per (tenant id,
version), wrapped under the master key, changed under ``state/keyring.lock`` and written
atomically; and the key tables an archive carries between keyrings."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, KeyUnavailableError
from .disk import dirfd
from .disk.fsio import SpecialFileError, fsync_dir, open_for_read, write_tmp
from .disk.locks import hold
from .erased_keys import ErasedKeys
from .master_key import FILE_ENV, MasterKey
from .sealed_objects import NONCE_BYTES, WIDE_VERSION

KEYRING_SCHEMA = "spoolctl-keyring/v1"

_MAX_VERSION = (1 << 63) - 1  # SQLite's json_extract reads it back as an integer
TID_RE = re.compile(r"[0-9a-f]{16}")
# A wrapped data key: nonce (12 bytes) then the 32-byte key and its 16-byte tag, in hex.
_WRAPPED_RE = re.compile(r"[0-9a-f]{120}")
_MAX_TABLE_KEYS = 1 << 16
_MAX_KEYRING = 16 << 20


# -- the keyring ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TenantKeys:
    """What the keyring holds for one tenant id: live versions, the current one (None: the
    next commit makes one), those that came in an archive, and whether it was revoked."""

    tenant_id: str
    versions: tuple[int, ...]
    current: int | None
    imported: tuple[int, ...] = ()
    revoked: bool = False


@dataclass(frozen=True)
class KeyTable:
    """The wrapped data keys an archive carries for one store's encrypted entries: the id
    of the master key they are wrapped under and ``(tenant id, version, wrapped)`` per key
    -- the keyring's own records, never a key in clear."""

    master_id: str
    keys: tuple[tuple[str, int, str], ...]

    def to_json(self) -> dict[str, Any]:
        return {"master_id": self.master_id,
                "keys": [{"tenant": t, "version": v, "wrapped": w} for t, v, w in self.keys]}

    @classmethod
    def from_json(cls, doc: Any) -> KeyTable:
        """The table in ``doc``; ArchiveError for anything ``to_json`` does not write."""
        from ..errors import ArchiveError

        bad = ArchiveError("archive index: malformed table of wrapped keys",
                           fix="the archive is damaged or hostile; do not import it")
        if not isinstance(doc, dict) or not isinstance(doc.get("master_id"), str) or \
                not TID_RE.fullmatch(doc["master_id"]) or not isinstance(doc.get("keys"), list) \
                or len(doc["keys"]) > _MAX_TABLE_KEYS:
            raise bad
        keys: list[tuple[str, int, str]] = []
        for k in doc["keys"]:
            if not isinstance(k, dict) or not isinstance(k.get("tenant"), str) or \
                    not TID_RE.fullmatch(k["tenant"]) or not valid_version(k.get("version")) \
                    or not isinstance(k.get("wrapped"), str) or \
                    not _WRAPPED_RE.fullmatch(k["wrapped"]):
                raise bad
            keys.append((k["tenant"], k["version"], k["wrapped"]))
        if len({(t, v) for t, v, _ in keys}) != len(keys):
            raise bad
        return cls(doc["master_id"], tuple(keys))


@dataclass
class KeyAdoption:
    """What ``Keyring.adopt`` did with an archive's key table."""

    added: list[tuple[str, int]] = field(default_factory=list)
    present: list[tuple[str, int]] = field(default_factory=list)
    # keys of a tenant revoked here, or erased here before: never taken
    refused: list[tuple[str, int]] = field(default_factory=list)


def read_key_table(state: Path, wanted: set[tuple[str, int]] | None) -> KeyTable | None:
    """The wrapped keys of ``wanted`` (None: every live key) that the keyring in ``state``
    still holds, read as they are (no master key needed: an exporter holds none); None
    without a keyring."""
    path = state / "keyring.json"
    if not path.exists():
        return None
    doc = _load_doc(path)
    if wanted is None:
        wanted = {(tid, int(v)) for tid, rec in doc["tenants"].items() if isinstance(rec, dict)
                  for v in rec.get("keys", {}) if str(v).isdigit()}
    keys = []
    for tid, version in sorted(wanted):
        rec = doc["tenants"].get(tid)
        wrapped = rec.get("keys", {}).get(str(version)) if isinstance(rec, dict) else None
        if isinstance(wrapped, str) and _WRAPPED_RE.fullmatch(wrapped):
            keys.append((tid, version, wrapped))
    master_id = doc.get("master_id")
    return KeyTable(master_id if isinstance(master_id, str) else "", tuple(keys))


def check_key_table(master: MasterKey | None, table: KeyTable, source: str) -> None:
    """Refuse, before anything is imported, a key table this host cannot use: no master key
    or another one (ConfigError, one line naming ``source`` and the fix), or a key that does
    not unwrap under it for its tenant and version (ArchiveError: damaged, or a wrapped key
    moved to another tenant). ``Keyring.adopt`` then merges it."""
    from ..errors import ArchiveError

    if not table.keys:
        return
    tenants = len({t for t, _, _ in table.keys})
    if master is None:
        raise ConfigError(
            f"the archive carries encrypted entries of {tenants} tenant(s) and no master key "
            "is configured here", path=source,
            fix=f"set {FILE_ENV} to the exporting host's master key (id {table.master_id}) "
                "and import again")
    if table.master_id != master.key_id:
        raise ConfigError(
            f"the archive's encrypted entries are wrapped under master key "
            f"{table.master_id or '(unknown)'}, this host's is {master.key_id}", path=source,
            fix=f"import with the exporting host's master key ({FILE_ENV}); the entries "
                "cannot be read without it")
    kek = master._lib.AESGCM(master.derive(b"key-wrapping"))
    for tid, version, wrapped in table.keys:
        try:
            kek.decrypt(bytes.fromhex(wrapped[:24]), bytes.fromhex(wrapped[24:]),
                        _wrap_aad(tid, version))
        except (ValueError, master._lib.InvalidTag):
            raise ArchiveError(
                f"the archive's key of tenant {tid} version {version} does not unwrap under "
                "this master key for that tenant and version", path=source,
                fix="the archive is damaged or hostile; do not import it") from None


def _load_doc(path: Path) -> dict[str, Any]:
    try:
        fd = open_for_read(path)
    except (OSError, SpecialFileError) as exc:
        raise ConfigError(f"the keyring cannot be read ({exc})", path=path,
                          fix="run as the store's owner; restore it from backup if lost") \
            from None
    try:
        # sized by the file (replaced by rename, never grown in place): a 16 MiB buffer per
        # reload cost more than the keyring's few kB
        data = os.read(fd, min(os.fstat(fd).st_size, _MAX_KEYRING) + 1)
    finally:
        os.close(fd)
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("schema") != KEYRING_SCHEMA or \
                not isinstance(doc.get("tenants"), dict):
            raise ValueError("not a keyring")
    except ValueError:
        raise ConfigError("the keyring is not valid", path=path,
                          fix="restore state/keyring.json from backup; without it the "
                              "encrypted entries are lost (they are misses)") from None
    return doc


def _current(rec: Mapping[str, Any]) -> int | None:
    """The version new objects of a tenant record use: its ``current``; a
    record written before it has none, and its newest counter is current."""
    keys = rec.get("keys") or {}
    if "current" in rec:
        cur = rec["current"]
        return cur if isinstance(cur, int) and str(cur) in keys else None
    return max((int(v) for v in keys), default=None)


def valid_version(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v <= _MAX_VERSION


class Keyring:
    """``state/keyring.json``: data keys wrapped under the master key (see module docstring)."""

    def __init__(self, state: Path, tmp: Path, master: MasterKey, *, lock_timeout: float,
                 read_only: bool = False, on_wide: Callable[[], Any] | None = None):
        """``on_wide``: called before the keyring first holds a random-id version (one that
        seals SPS2 objects), and by ``mark_wide`` -- the store makes its marker require
        them there, so a spoolctl that reads only SPS1 refuses the store."""
        self.path = state / "keyring.json"
        self._on_wide = on_wide
        self._lock = state / "keyring.lock"
        self._tmp = tmp
        self._master = master
        self._kek = master._lib.AESGCM(master.derive(b"key-wrapping"))
        self._lock_timeout = lock_timeout
        self._read_only = read_only
        self._seen: tuple[int, int, int] | None = None
        self._doc: dict[str, Any] = _empty(master.key_id)
        self._keys: dict[tuple[str, int], bytes] = {}
        # erased keys are recorded outside the store: a restored keyring cannot bring one back
        self.erased = ErasedKeys(master.ledger, master.derive(b"erased-key-fingerprints"))

    # reading

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def refresh(self) -> dict[str, Any]:
        """The keyring as it is on disk now (reloaded only when the file changed), and the
        ledger of erased keys (likewise)."""
        if self.erased.refresh():
            self._keys = {}
        sig = self._signature()
        if sig != self._seen:
            self._doc = _load_doc(self.path) if sig is not None else _empty(self._master.key_id)
            self._keys = {}
            self._seen = sig
        return self._doc

    @property
    def master_matches(self) -> bool:
        """False when the keyring was written under another master key (lost or wrong key)."""
        return self.refresh().get("master_id") == self._master.key_id

    def tenants(self) -> list[TenantKeys]:
        out = []
        for tid, rec in sorted(self.refresh()["tenants"].items()):
            versions = tuple(sorted(int(v) for v in rec.get("keys", {})))
            imported = tuple(v for v in versions if str(v) in (rec.get("imported") or {}))
            out.append(TenantKeys(tid, versions, _current(rec), imported,
                                  bool(rec.get("revoked"))))
        return out

    def data_key(self, tid: str, version: int) -> bytes | None:
        """The data key of ``tid`` at ``version``, or None (revoked, retired, never made, or
        the keyring belongs to another master key)."""
        doc = self.refresh()
        cached = self._keys.get((tid, version))
        if cached is not None:
            return cached
        rec = doc["tenants"].get(tid)
        wrapped = rec.get("keys", {}).get(str(version)) if isinstance(rec, dict) else None
        if not isinstance(wrapped, str) or doc.get("master_id") != self._master.key_id:
            return None
        key = self._unwrap(tid, version, wrapped)
        if key is None or self.erased.erased(key):
            return None
        self._keys[(tid, version)] = key
        return key

    def _unwrap(self, tid: str, version: int, wrapped: str) -> bytes | None:
        try:
            key: bytes = self._kek.decrypt(bytes.fromhex(wrapped[:24]),
                                           bytes.fromhex(wrapped[24:]), _wrap_aad(tid, version))
            return key
        except (ValueError, self._master._lib.InvalidTag):
            return None

    def current(self, tid: str) -> tuple[int, bytes]:
        """The version and key new objects of ``tid`` are sealed with (made on first use)."""
        rec = self.refresh()["tenants"].get(tid)
        if isinstance(rec, dict) and (version := _current(rec)) is not None:
            key = self.data_key(tid, version)
            if key is not None:
                return version, key
        self._change(lambda doc: self._add_version(doc, tid, only_if_none=True))
        version = _current(self.refresh()["tenants"][tid])
        key = self.data_key(tid, version) if version is not None else None
        if version is None or key is None:
            raise KeyUnavailableError("the keyring was written under another master key",
                                      path=self.path, fix="configure the store's master key")
        return version, key

    def mark_wide(self) -> None:
        """Call ``on_wide`` if the keyring already holds (or held) a random-id version: a
        store whose SPS2 keys were made before the marker named them gets it at the next
        writable open."""
        if self._on_wide is not None and not self._read_only and _has_wide(self.refresh()):
            self._on_wide()

    # changing

    def rotate(self, tids: list[str] | None = None) -> dict[str, int]:
        """Add a new current version for ``tids`` (default: every tenant); returns them."""
        made: dict[str, int] = {}

        def change(doc: dict[str, Any]) -> None:
            for tid in (tids if tids is not None else list(doc["tenants"])):
                made[tid] = self._add_version(doc, tid, only_if_none=False)
        self._change(change)
        return made

    def revoke(self, tid: str) -> list[int]:
        """Erase every data key of ``tid`` and remember the revoke (no archive brings one of
        its keys back); returns the versions erased."""
        return self.retire(tid, keep=None, revoke=True)

    def retire(self, tid: str, keep: int | None, *, revoke: bool = False) -> list[int]:
        """Erase every data key of ``tid`` but version ``keep`` (None: all); returns the
        versions erased. Erased versions are remembered: an archive never brings one back."""
        gone: list[int] = []

        def change(doc: dict[str, Any]) -> None:
            rec = doc["tenants"].get(tid)
            if rec is None:
                if not revoke:
                    return
                rec = doc["tenants"][tid] = {"keys": {}}
            keys = rec.setdefault("keys", {})
            if "current" not in rec:  # a record from before ``current`` existed: pin it
                rec["current"] = _current(rec)
            # recorded outside the store first: no restored copy of this keyring unwraps them
            self.erased.record([k for v, w in keys.items() if (keep is None or int(v) != keep)
                                and (k := self._unwrap(tid, int(v), w)) is not None])
            for v in sorted(int(v) for v in keys):
                if keep is None or v != keep:
                    del keys[str(v)]
                    (rec.get("imported") or {}).pop(str(v), None)
                    gone.append(v)
            rec["erased"] = sorted(set(rec.get("erased", [])) | set(gone))
            if revoke:
                rec["revoked"] = time.time()
                rec["current"] = None
        self._change(change)
        return gone

    def adopt(self, table: KeyTable, source: str) -> KeyAdoption:
        """Merge the wrapped keys an archive (``source``) carries into this keyring, so its
        encrypted entries read here; all or nothing.

        ConfigError (one line) when they are wrapped under another master key; ArchiveError
        when one does not unwrap under it for its tenant and version (damaged, or a key
        moved between tenants) or collides with another key of the same (tenant, version)
        here. A key of a tenant revoked here, or one erased here, is ``refused`` (its
        entries are skipped), never taken back."""
        from ..errors import ArchiveError

        check_key_table(self._master, table, source)
        unwrapped: dict[tuple[str, int], tuple[str, bytes]] = {}
        for tid, version, wrapped in table.keys:
            key = self._unwrap(tid, version, wrapped)
            assert key is not None  # checked above
            unwrapped[(tid, version)] = (wrapped, key)
        done = KeyAdoption()

        def change(doc: dict[str, Any]) -> None:
            adding: list[tuple[str, int, str]] = []
            for (tid, version), (wrapped, key) in unwrapped.items():
                rec = doc["tenants"].get(tid) or {}
                if rec.get("revoked") or version in rec.get("erased", []) or \
                        self.erased.erased(key):
                    done.refused.append((tid, version))
                    continue
                have = rec.get("keys", {}).get(str(version))
                if have is None:
                    adding.append((tid, version, wrapped))
                    continue
                if self._unwrap(tid, version, have) != key:
                    raise ArchiveError(
                        f"the archive's key of tenant {tid} version {version} is not the key "
                        "this store holds under that tenant and version", path=source,
                        fix="the archive is hostile (key ids are random 63-bit numbers and "
                            "do not collide by chance); do not import it")
                done.present.append((tid, version))
            now = time.time()
            for tid, version, wrapped in adding:
                rec = doc["tenants"].setdefault(tid, {"keys": {}, "current": None})
                rec.setdefault("keys", {})
                if "current" not in rec:  # a record from before ``current`` existed: pin it
                    rec["current"] = _current(rec)
                rec["keys"][str(version)] = wrapped
                rec.setdefault("imported", {})[str(version)] = now
                done.added.append((tid, version))
        if unwrapped:
            self._change(change)
        return done

    def _add_version(self, doc: dict[str, Any], tid: str, *, only_if_none: bool) -> int:
        rec = doc["tenants"].setdefault(tid, {"keys": {}})
        keys = rec.setdefault("keys", {})
        if only_if_none and (cur := _current(rec)) is not None:
            return cur
        version = new_version(set(keys) | {str(v) for v in rec.get("erased", [])})
        nonce = secrets.token_bytes(NONCE_BYTES)
        wrapped = self._kek.encrypt(nonce, secrets.token_bytes(32), _wrap_aad(tid, version))
        keys[str(version)] = nonce.hex() + wrapped.hex()
        rec["current"] = version
        return version

    def _change(self, change: Any) -> None:
        if self._read_only:
            from ..errors import ReadOnlyError
            raise ReadOnlyError("the store is open read-only: its keyring cannot change",
                                path=self.path, fix="open it writable (as its owner)")
        with hold(self._lock, exclusive=True, timeout=self._lock_timeout,
                  what="changing the keyring"):
            self._seen = None
            doc = self.refresh()
            if doc.get("master_id") != self._master.key_id:
                raise KeyUnavailableError(
                    "the keyring was written under another master key", path=self.path,
                    fix="configure the master key this store was made with (docs/runbook.md, "
                        "key loss)")
            try:
                change(doc)
                if self._on_wide is not None and _has_wide(doc):
                    self._on_wide()  # the marker first, so no older spoolctl reads such a key
            except BaseException:
                self._seen = None  # the copy in memory may be half changed: reload it
                raise
            doc["changed"] = time.time()
            data = json.dumps(doc, sort_keys=True, indent=1).encode() + b"\n"
            tmp, _, _ = write_tmp(self._tmp, [data])
            try:
                dirfd.replace(tmp, self.path)
            except OSError:
                with contextlib.suppress(OSError):
                    dirfd.unlink(tmp)
                raise
            fsync_dir(self.path.parent)
            self._seen = None


def _has_wide(doc: Mapping[str, Any]) -> bool:
    """True if a tenant of ``doc`` has, or had (erased: its objects may still lie on disk),
    a random-id version: objects with SPS2 headers."""
    for rec in doc["tenants"].values():
        if isinstance(rec, dict):
            versions = [*(rec.get("keys") or {}), *(rec.get("erased") or [])]
            if any(str(v).isdigit() and int(v) >= WIDE_VERSION for v in versions):
                return True
    return False


def _empty(master_id: str) -> dict[str, Any]:
    return {"schema": KEYRING_SCHEMA, "master_id": master_id, "tenants": {}}


def _wrap_aad(tid: str, version: int) -> bytes:
    return f"spoolctl-wrap/v1 {tid} {version}".encode()


# -- sealing objects ---------------------------------------------------------------------


def new_version(taken: Any = ()) -> int:
    """A fresh key version: a random 63-bit id above the legacy counters, not in ``taken``.
    Random, not counted, so two hosts under one master key never give the same (tenant,
    version) to two different keys."""
    while True:
        version = WIDE_VERSION + secrets.randbelow(_MAX_VERSION - WIDE_VERSION)
        if str(version) not in taken and version not in taken:
            return version
