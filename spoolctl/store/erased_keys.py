"""The ledger of erased data keys: what makes a revoke (or a retire) survive a restore of the
store's own files.

The keyring lives in the store, so a copy of the store taken before a revoke -- keyring and
objects, no key needed to take it -- would bring the revoked keys back when restored. The
ledger lives outside the store (``SPOOLCTL_KEY_LEDGER``; by default beside the master key
file), where the store's writers cannot reach it: a revoke records there a fingerprint of
every data key it erases *before* erasing it from the keyring, and the keyring never hands
out a key whose fingerprint is recorded, whatever keyring.json says and wherever a wrapped
key came from (a restored keyring, an archive).

Fingerprints are keyed hashes under a key derived from the master key: the ledger says
nothing about the keys, and ledgers of two master keys can share one file. A missing
ledger file is an empty one (nothing revoked yet); one that is not a private regular file
of this user or root, or not valid, is refused (ConfigError): fail closed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import blake3

from ..errors import ConfigError
from .disk.fsio import fsync_dir, write_tmp
from .disk.locks import hold

LEDGER_ENV = "SPOOLCTL_KEY_LEDGER"
LEDGER_SCHEMA = "spoolctl-erased-keys/v1"
DEFAULT_SUFFIX = ".erased"  # the default ledger: the master key file's path + this
_FP_RE = re.compile(r"[0-9a-f]{32}")
_MAX_LEDGER = 64 << 20
_LOCK_TIMEOUT = 30.0
_FIX = (f"set {LEDGER_ENV} to a file outside the store that only the operator (root) and "
        "the service account can write, the same in every process of the deployment")


class ErasedKeys:
    """The ledger at ``path`` as seen with master key ``fp_key`` (``MasterKey.derive``'d):
    ``erased(key)`` asks, ``record(keys)`` adds. ``path`` None: no ledger configured --
    nothing is recorded as erased, and ``record`` refuses (a revoke would not survive a
    restore of the store)."""

    def __init__(self, path: Path | None, fp_key: bytes):
        self.path = path
        self._fp_key = fp_key
        self._seen: tuple[int, int, int] | None = None
        self._erased: frozenset[str] = frozenset()

    def fingerprint(self, key: bytes) -> str:
        return blake3.blake3(key, key=self._fp_key).hexdigest()[:32]

    def refresh(self) -> bool:
        """Reload the ledger if the file changed since it was last read; True if it did."""
        if self.path is None:
            return False
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            changed = self._seen is not None
            self._seen, self._erased = None, frozenset()
            return changed
        except OSError as exc:
            raise _unreadable(self.path, exc) from None
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        if sig == self._seen:
            return False
        self._erased = frozenset(_read(self.path))
        self._seen = sig
        return True

    def erased(self, key: bytes) -> bool:
        """True if ``key`` was erased (its fingerprint is in the ledger as last refreshed)."""
        return bool(self._erased) and self.fingerprint(key) in self._erased

    def record(self, keys: list[bytes]) -> None:
        """Add ``keys`` to the ledger, durably (under ``<ledger>.lock``, written whole and
        renamed into place). ConfigError (one line) when no ledger is configured or it
        cannot be written: nothing is erased then."""
        if not keys:
            return
        if self.path is None:
            raise ConfigError("a revoke must be recorded outside the store, or a restored "
                              "backup of the store would decrypt the tenant again; no key "
                              "ledger is configured", fix=_FIX)
        path = self.path
        try:
            with hold(path.with_name(path.name + ".lock"), exclusive=True,
                      timeout=_LOCK_TIMEOUT, what="recording erased keys"):
                have = set(_read(path)) if os.path.lexists(path) else set()
                have |= {self.fingerprint(k) for k in keys}
                doc = {"schema": LEDGER_SCHEMA, "erased": sorted(have)}
                data = json.dumps(doc, indent=0).encode() + b"\n"
                tmp, _, _ = write_tmp(path.parent, [data])
                try:
                    os.chmod(tmp, 0o644)  # the service account reads what root records
                    os.replace(tmp, path)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
                fsync_dir(path.parent)
        except (OSError, ConfigError) as exc:
            why = exc.message if isinstance(exc, ConfigError) else \
                os.strerror(exc.errno or 0) if isinstance(exc, OSError) and exc.errno else str(exc)
            raise ConfigError(f"the key ledger cannot be written ({why}); nothing was erased",
                              path=path, fix=f"run as its owner (root), or {_FIX}") from None
        self._seen = None
        self.refresh()


def _unreadable(path: Path, exc: OSError) -> ConfigError:
    return ConfigError(f"the key ledger cannot be read ({os.strerror(exc.errno or 0)})",
                       path=path, fix=f"run as the service account or root; {_FIX}")


def _read(path: Path) -> list[str]:
    """The fingerprints in the ledger at ``path``: a regular file (not a symlink) owned by
    this user or root (root reads any), that neither its group nor others can write."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise _unreadable(path, exc) from None
    try:
        st = os.fstat(fd)
        euid = os.geteuid()
        if not stat.S_ISREG(st.st_mode) or (euid != 0 and st.st_uid not in (euid, 0)) or \
                st.st_mode & 0o022:
            raise ConfigError("the key ledger is not a regular file of this user or root that "
                              "only its owner can write", path=path,
                              fix=f"chown root and chmod 644 it; {_FIX}")
        data = os.read(fd, min(st.st_size, _MAX_LEDGER) + 1)
    finally:
        os.close(fd)
    try:
        doc: Any = json.loads(data)
        erased = doc["erased"]
        if doc.get("schema") != LEDGER_SCHEMA or not isinstance(erased, list) or \
                not all(isinstance(f, str) and _FP_RE.fullmatch(f) for f in erased):
            raise ValueError("not a ledger")
    except (ValueError, TypeError, KeyError):
        raise ConfigError("the key ledger is not valid", path=path,
                          fix="restore it from the operator's copy; never delete it (revoked "
                              "tenants would decrypt again from a restored store)") from None
    return erased


def ledger_for(key_file: str | None, environ: Any) -> Path | None:
    """Where the ledger of a master key is: ``SPOOLCTL_KEY_LEDGER`` (an absolute path) if
    set, else beside the key file (``<key file>.erased``), else None."""
    given = environ.get(LEDGER_ENV)
    if given:
        if not os.path.isabs(given):
            raise ConfigError(f"{LEDGER_ENV} must be an absolute path", path=given, fix=_FIX)
        return Path(given)
    if key_file:
        return Path(key_file + DEFAULT_SUFFIX)
    return None


def check_outside(path: Path | None, root: Path) -> None:
    """ConfigError if the ledger would lie inside the store root (a restore would undo it)."""
    if path is None:
        return
    real, base = os.path.realpath(path), os.path.realpath(root)
    if real == base or real.startswith(base.rstrip("/") + "/"):
        raise ConfigError("the key ledger is inside the store root", path=path, fix=_FIX)
