"""The master key of encryption at rest: where it comes from (file, value or command),
and the keys derived from it. The key itself is never shown, only ``key_id``."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .erased_keys import check_outside as check_ledger_outside
from .erased_keys import ledger_for
from .format.entry_tags import read_key_file

FILE_ENV = "SPOOLCTL_MASTER_KEY_FILE"
VALUE_ENV = "SPOOLCTL_MASTER_KEY"
COMMAND_ENV = "SPOOLCTL_MASTER_KEY_COMMAND"
COMMAND_TIMEOUT = 10.0

_KEY_RE = re.compile(r"[0-9a-fA-F]{64}")
_MAX_KEY_FILE = 4096
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
        key: bytes = lib.HKDF(algorithm=lib.hashes.SHA256(), length=length, salt=None,
                              info=b"spoolctl/v1 " + label).derive(self._key)
        return key

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
