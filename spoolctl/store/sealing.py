"""Encryption at rest with per-tenant keys (decision 2800): the master key, the store's keyring
of wrapped data keys, and the tenant policy of sealed objects (``sealed_objects`` seals them).

Off unless a master key is configured; then ``cryptography`` is needed (the ``crypto`` extra)
and is imported here only. Contracts:

* ``MasterKey.from_environment`` reads exactly one of ``SPOOLCTL_MASTER_KEY_FILE``,
  ``SPOOLCTL_MASTER_KEY`` or ``SPOOLCTL_MASTER_KEY_COMMAND`` (64 hex characters; the command's
  stdout, for a KMS/Vault agent); None when none is set; ConfigError (one line) otherwise.
  The key is never shown: only ``key_id``.
* ``Keyring`` (``state/keyring.json``) holds one random data key per (tenant id, version),
  wrapped under a key derived from the master key. Every change is made under
  ``state/keyring.lock`` and written atomically (temp file, fsync, rename, fsync the
  directory); readers reload it when the file changed, so a revoke in one process is seen by
  the next read of every other process. A version is a random 63-bit id (decision 2812;
  stores from before it keep their counters 1, 2, ...), so (tenant id, version) names one key
  on every host under one master key and a key can travel in an archive (``KeyTable``,
  ``Keyring.adopt``); erased versions are remembered and never taken back.
  Erased keys are also recorded in the key ledger outside the store (``erased_keys``,
  decision 3021): the keyring never hands one out again, whatever keyring.json says.
* ``Sealer.seal`` returns ``HEADER | ciphertext | tag`` for one payload, bound to its entry
  and name (decision 3020); ``Sealer.open`` reads one object and decrypts it in one pass
  against the binding the reader built (``read_binding``: the GCM tag is the integrity and
  placement check), raising ``KeyUnavailableError`` (a miss, nothing quarantined) when the
  key is gone or the entry predates binding, and ``CorruptionError`` otherwise.
* Tenant names are never stored: ``tenant_id`` is an opaque 16-hex id derived with the master
  key; entry keys of a tenant are replaced by a keyed hash (``sealed_key``), so equal prompts of
  two tenants give unrelated entry ids.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import blake3

from ..errors import ConfigError, CorruptionError, KeyUnavailableError, QuarantineReason
from . import sealed_objects
from .commit.committer import PutRequest
from .disk import dirfd
from .disk.fsio import SpecialFileError, fsync_dir, open_for_read, write_tmp
from .disk.locks import hold
from .erased_keys import ErasedKeys, ledger_for
from .erased_keys import check_outside as check_ledger_outside
from .format.entry_tags import read_key_file
from .format.keys import TenantId, entry_id_for
from .sealed_objects import (  # noqa: F401  (the header constants are part of this API)
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

FILE_ENV = "SPOOLCTL_MASTER_KEY_FILE"
VALUE_ENV = "SPOOLCTL_MASTER_KEY"
COMMAND_ENV = "SPOOLCTL_MASTER_KEY_COMMAND"
COMMAND_TIMEOUT = 10.0
KEYRING_SCHEMA = "spoolctl-keyring/v1"
DEFAULT_TENANT = "default"
INDEX_FIELD = "sealed"  # the manifest index fact: {"tenant": tid, "version": n, "bound": true}

_MAX_VERSION = (1 << 63) - 1  # SQLite's json_extract reads it back as an integer

_KEY_RE = re.compile(r"[0-9a-fA-F]{64}")
_TID_RE = re.compile(r"[0-9a-f]{16}")
# A wrapped data key: nonce (12 bytes) then the 32-byte key and its 16-byte tag, in hex.
_WRAPPED_RE = re.compile(r"[0-9a-f]{120}")
_MAX_TABLE_KEYS = 1 << 16
_MAX_KEY_FILE = 4096
_MAX_KEYRING = 16 << 20
# Naming keys kept per process (one per tenant seen; recomputed after the cache is cleared).
_NAME_KEYS_KEPT = 4096
_EXTRA_FIX = "install the extra: pip install 'spoolctl[crypto]' (or unset the master key)"


def _crypto() -> Any:
    """The ``cryptography`` pieces used here; ConfigError naming the extra when absent."""
    try:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError:
        raise ConfigError("encryption at rest is configured but the `cryptography` package "
                          "is not installed", fix=_EXTRA_FIX) from None
    return _Lib(InvalidTag, hashes, Cipher, algorithms, modes, AESGCM, HKDF)


@dataclass(frozen=True)
class _Lib:
    InvalidTag: Any
    hashes: Any
    Cipher: Any
    algorithms: Any
    modes: Any
    AESGCM: Any
    HKDF: Any


# -- the master key ------------------------------------------------------------------------


class MasterKey:
    """The 32-byte master key. ``source`` names where it came from; the key is never shown."""

    __slots__ = ("_key", "_lib", "key_id", "ledger", "source")

    def __init__(self, key: bytes, source: str, ledger: Path | None = None):
        """``ledger``: the file outside the store where erased keys are recorded
        (``erased_keys``); None: none, and a revoke is refused."""
        if not isinstance(key, bytes) or len(key) != 32:
            raise ConfigError("a master key is 32 bytes", fix="generate one: openssl rand -hex 32")
        self._lib = _crypto()
        self._key = key
        self.source = source
        self.ledger = ledger
        self.key_id = self.derive(b"key-id").hex()[:16]

    def __repr__(self) -> str:
        return f"MasterKey(id={self.key_id}, source={self.source!r})"

    def derive(self, label: bytes, length: int = 32) -> bytes:
        """HKDF-SHA256 of the master key for ``label`` (each use has its own label)."""
        lib = self._lib
        return lib.HKDF(algorithm=lib.hashes.SHA256(), length=length, salt=None,
                        info=b"spoolctl/v1 " + label).derive(self._key)

    @classmethod
    def from_hex(cls, text: str, source: str, ledger: Path | None = None) -> MasterKey:
        text = text.strip()
        if not _KEY_RE.fullmatch(text):
            raise ConfigError(f"{source} does not hold a master key (64 hex characters)",
                              fix="write one with: openssl rand -hex 32")
        return cls(bytes.fromhex(text), source, ledger)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> MasterKey:
        """The key in ``path``: an absolute path to a regular file (not a symlink) owned by
        this user or root, with no access for group or others; ConfigError otherwise."""
        path = Path(path)
        data = read_key_file(path, what="the master key file", env=FILE_ENV, others=0o077,
                             mode_fix=f"chmod 600 {path}")
        text = data.decode("ascii", "replace") if len(data) <= _MAX_KEY_FILE else ""
        return cls.from_hex(text, str(path), ledger_for(str(path), os.environ))

    @classmethod
    def from_command(cls, command: str) -> MasterKey:
        """The key printed by ``command`` (split like a shell would, run without one)."""
        try:
            argv = shlex.split(command)
        except ValueError as exc:
            raise ConfigError(f"{COMMAND_ENV} cannot be parsed ({exc})",
                              fix="quote it as a shell would") from None
        if not argv:
            raise ConfigError(f"{COMMAND_ENV} is empty", fix="name the command that prints the key")
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=COMMAND_TIMEOUT, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = "timed out" if isinstance(exc, subprocess.TimeoutExpired) else \
                f"could not start ({exc.strerror or exc})"
            raise ConfigError(f"the master key command {why}", path=argv[0],
                              fix=f"check {COMMAND_ENV}") from None
        if done.returncode != 0:
            raise ConfigError(f"the master key command exited with {done.returncode}",
                              path=argv[0], fix=f"run it by hand to see why ({COMMAND_ENV})")
        out = done.stdout[:_MAX_KEY_FILE].decode("ascii", "replace")
        return cls.from_hex(out, f"the output of {COMMAND_ENV}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> MasterKey | None:
        """The key from exactly one of the three variables; None when none is set."""
        env = os.environ if environ is None else environ
        given = [(name, env.get(name)) for name in (FILE_ENV, VALUE_ENV, COMMAND_ENV)
                 if env.get(name)]
        if not given:
            return None
        if len(given) > 1:
            raise ConfigError(f"{' and '.join(n for n, _ in given)} are all set",
                              fix="set only one source of the master key")
        name, value = given[0]
        assert value is not None
        if name == FILE_ENV:
            key = cls.from_file(value)
        elif name == VALUE_ENV:
            key = cls.from_hex(value, VALUE_ENV)
        else:
            key = cls.from_command(value)
        key.ledger = ledger_for(value if name == FILE_ENV else None, env)
        return key

    def check_outside(self, root: Path) -> None:
        """ConfigError if the key file or the key ledger lies inside the store root."""
        check_ledger_outside(self.ledger, root)
        if not self.source.startswith("/"):
            return
        real, base = os.path.realpath(self.source), os.path.realpath(root)
        if real == base or real.startswith(base.rstrip("/") + "/"):
            raise ConfigError("the master key file is inside the store root", path=self.source,
                              fix="keep the key outside the store (e.g. /etc/spoolctl/master.key)")


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
    """The wrapped data keys an archive carries for one store's encrypted entries (decision
    2813): the id of the master key they are wrapped under and ``(tenant id, version,
    wrapped)`` per key -- the keyring's own records, never a key in clear."""

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
                not _TID_RE.fullmatch(doc["master_id"]) or not isinstance(doc.get("keys"), list) \
                or len(doc["keys"]) > _MAX_TABLE_KEYS:
            raise bad
        keys: list[tuple[str, int, str]] = []
        for k in doc["keys"]:
            if not isinstance(k, dict) or not isinstance(k.get("tenant"), str) or \
                    not _TID_RE.fullmatch(k["tenant"]) or not _valid_version(k.get("version")) \
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
    # keys of a tenant revoked here, or erased here before: never taken (decision 2813)
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
    """The version new objects of a tenant record use: its ``current`` (decision 2812); a
    record written before it has none, and its newest counter is current."""
    keys = rec.get("keys") or {}
    if "current" in rec:
        cur = rec["current"]
        return cur if isinstance(cur, int) and str(cur) in keys else None
    return max((int(v) for v in keys), default=None)


def _valid_version(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v <= _MAX_VERSION


class Keyring:
    """``state/keyring.json``: data keys wrapped under the master key (see module docstring)."""

    def __init__(self, state: Path, tmp: Path, master: MasterKey, *, lock_timeout: float,
                 read_only: bool = False, on_wide: Callable[[], Any] | None = None):
        """``on_wide``: called before the keyring first holds a random-id version (one that
        seals SPS2 objects), and by ``mark_wide`` -- the store makes its marker require
        them there, so a spoolctl that reads only SPS1 refuses the store (decision 2831)."""
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
            return self._kek.decrypt(bytes.fromhex(wrapped[:24]), bytes.fromhex(wrapped[24:]),
                                     _wrap_aad(tid, version))
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
        store whose SPS2 keys were made before decision 2831 gets its marker at the next
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
        its keys back, decision 2813); returns the versions erased."""
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
            if "current" not in rec:  # a record from before decision 2812: pin it
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
        encrypted entries read here; all or nothing (decision 2813).

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
                if "current" not in rec:  # a record from before decision 2812: pin it
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
                    self._on_wide()  # before the keyring names such a key (decision 2831)
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

    def key_available(self, manifest: Any) -> bool:
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
            _TID_RE.fullmatch(fact["tenant"]) and _valid_version(fact.get("version")):
        return fact["tenant"], fact["version"]
    return None


def _bound(index: Mapping[str, Any] | None) -> bool:
    """Whether a sealed entry's objects are bound to it (SPS3): its fact says so."""
    fact = (index or {}).get(INDEX_FIELD)
    return isinstance(fact, Mapping) and fact.get("bound") is True


def plain_size(manifest: Any, name: str) -> int:
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
        return tid if key[18:19] == ":" and _TID_RE.fullmatch(tid) else None
    return key[:16] if _TID_RE.fullmatch(key[:16]) else None


def read_binding(manifest: Any, name: str) -> Binding:
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


def new_version(taken: Any = ()) -> int:
    """A fresh key version: a random 63-bit id above the legacy counters, not in ``taken``.
    Random, not counted, so two hosts under one master key never give the same (tenant,
    version) to two different keys (decision 2812)."""
    while True:
        version = WIDE_VERSION + secrets.randbelow(_MAX_VERSION - WIDE_VERSION)
        if str(version) not in taken and version not in taken:
            return version


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
    and say so rather than write entries that are never found (decision 2800, item 6)."""
    if getattr(store, "sealer", None) is not None:
        raise ConfigError(f"{consumer} does not support encryption at rest yet",
                          path=getattr(store, "root", None),
                          fix=f"unset {FILE_ENV}/{VALUE_ENV}/{COMMAND_ENV} for this process, "
                              "or use a store without encryption")
