"""Entry authentication tags: a keyed MAC the store's writer cannot forge.

Digests do not prove who wrote a manifest: anyone who can write the store can recompute
them. A tag is keyed BLAKE3 over the manifest's envelope digest (which covers the whole
body), so a valid tag proves the entry was committed by a holder of the key. The key is
held by the engine and the operator only, never in a store root:

* ``SPOOLCTL_TAG_KEY_FILE``: a private regular file holding 64 hex characters;
* ``SPOOLCTL_TAG_KEY``: the 64 hex characters themselves.

With a key, every commit tags its manifest and every ``Store.manifest`` checks the tag (an
entry without a valid one is quarantined, ``auth_tag``). Without a key nothing is tagged.
"""

from __future__ import annotations

import errno
import hmac
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import blake3

from ...errors import ConfigError

KEY_FILE_ENV = "SPOOLCTL_TAG_KEY_FILE"
KEY_ENV = "SPOOLCTL_TAG_KEY"
ALGORITHM = "blake3-keyed/v1"
_CONTEXT = b"spoolctl-entry-tag/v1\x00"
_KEY_RE = re.compile(r"[0-9a-fA-F]{64}")
_MAX_KEY_FILE = 4096


class _FromEnvironment:
    """Sentinel: resolve the key from the environment (``TagKey.from_environment``)."""

    def __repr__(self) -> str:
        return "FROM_ENVIRONMENT"


FROM_ENVIRONMENT: Any = _FromEnvironment()


class TagKey:
    """One 32-byte tag key. ``source`` says where it came from (a file path or the
    variable's name), for error lines; the key itself is never shown."""

    __slots__ = ("_key", "key_id", "source")

    def __init__(self, key: bytes, source: str = "a key"):
        if not isinstance(key, bytes) or len(key) != 32:
            raise ConfigError("a tag key is 32 bytes", fix="generate one: openssl rand -hex 32")
        self._key = key
        self.source = source
        # Derived with the key, so it names the key without revealing anything about it.
        self.key_id = blake3.blake3(b"spoolctl-key-id/v1", key=key).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"TagKey(id={self.key_id}, source={self.source!r})"

    # -- loading ---------------------------------------------------------------------

    @classmethod
    def from_hex(cls, text: str, source: str) -> TagKey:
        text = text.strip()
        if not _KEY_RE.fullmatch(text):
            raise ConfigError(f"{source} does not hold a tag key (64 hex characters)",
                              fix="write one with: openssl rand -hex 32")
        return cls(bytes.fromhex(text), source)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> TagKey:
        """The key in ``path``; ConfigError (naming the file and the fix) unless it is a
        regular file, not a symlink, owned by this user or root, with no access for others
        and no group write."""
        path = Path(path)
        data = read_key_file(path, what="the tag key file", env=KEY_FILE_ENV, others=0o027,
                             mode_fix=f"chmod 600 {path} (or 640 with a group of its readers)")
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError:
            text = ""
        return cls.from_hex(text if len(data) <= _MAX_KEY_FILE else "", str(path))

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> TagKey | None:
        """The operator's key from ``SPOOLCTL_TAG_KEY_FILE`` or ``SPOOLCTL_TAG_KEY``; None
        when neither is set; ConfigError when both are, or the one set is unusable."""
        env = os.environ if environ is None else environ
        file, value = env.get(KEY_FILE_ENV) or None, env.get(KEY_ENV) or None
        if file and value:
            raise ConfigError(f"both {KEY_FILE_ENV} and {KEY_ENV} are set",
                              fix="set only one of them")
        if file:
            return cls.from_file(file)
        if value:
            return cls.from_hex(value, KEY_ENV)
        return None

    def check_outside(self, root: Path) -> None:
        """ConfigError if this key's file lies inside the store root ``root`` (the store's
        writer could then read or replace it)."""
        if not self.source.startswith("/"):
            return
        real, base = os.path.realpath(self.source), os.path.realpath(root)
        if real == base or real.startswith(base.rstrip("/") + "/"):
            raise ConfigError("the tag key file is inside the store root", path=self.source,
                              fix="keep the key outside the store (e.g. /etc/spoolctl/tag.key)")

    # -- tagging and checking --------------------------------------------------------

    def mac(self, envelope_digest: str) -> str:
        """The tag of a manifest whose envelope digest is ``envelope_digest``."""
        return blake3.blake3(_CONTEXT + envelope_digest.encode("ascii"),
                             key=self._key).hexdigest()

    def tag(self, envelope_digest: str) -> dict[str, str]:
        """The envelope's ``tag`` field."""
        return {"alg": ALGORITHM, "key_id": self.key_id, "mac": self.mac(envelope_digest)}

    def problem(self, tag: Mapping[str, Any] | None, envelope_digest: str) -> str | None:
        """Why ``tag`` does not authenticate a manifest with ``envelope_digest`` under this
        key (one phrase), or None when it does."""
        if tag is None:
            return "it carries no authentication tag (written without this key)"
        if tag.get("alg") != ALGORITHM:
            return f"its tag algorithm {str(tag.get('alg'))[:32]!r} is unknown"
        if tag.get("key_id") != self.key_id:
            return (f"it is tagged with another key ({str(tag.get('key_id'))[:16]}; "
                    f"this key is {self.key_id})")
        if not hmac.compare_digest(str(tag.get("mac")), self.mac(envelope_digest)):
            return "its authentication tag does not match (forged or altered)"
        return None


def check_tag_field(value: Any) -> dict[str, str]:
    """The envelope's optional ``tag`` as decoded JSON, validated for shape only; ValueError
    for anything that is not ``{"alg", "key_id", "mac"}`` of short text."""
    if not isinstance(value, dict) or set(value) != {"alg", "key_id", "mac"} or not all(
            isinstance(v, str) and len(v) <= 128 for v in value.values()):
        raise ValueError("malformed authentication tag")
    return dict(value)


def read_key_file(path: Path, *, what: str, env: str, others: int, mode_fix: str) -> bytes:
    """The bytes of a key file (at most ``_MAX_KEY_FILE + 1``: a longer file is no key),
    checked the one way every key file of spoolctl is (the tag key, the master key):
    an absolute path to a regular file, not a symlink, owned by this user or root, with
    none of the ``others`` mode bits. ConfigError naming ``what``, the file and the fix."""
    if not path.is_absolute():
        raise ConfigError(f"{what} must be an absolute path", path=path,
                          fix=f"set {env} to an absolute path")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | \
        getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        why = "is a symlink" if exc.errno == errno.ELOOP else \
            f"cannot be read ({os.strerror(exc.errno or 0)})"
        raise ConfigError(f"{what} {why}", path=path,
                          fix="point at the real key file, readable by this user") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} is not a regular file", path=path,
                              fix="write the key into a regular file")
        if st.st_uid not in (os.geteuid(), 0):
            raise ConfigError(f"{what} belongs to another user", path=path,
                              fix="own it by the service account or root")
        if st.st_mode & others:
            who = "others can read it or its group can write it" if others == 0o027 else \
                "its group or others can access it"
            raise ConfigError(f"{what} has mode {stat.S_IMODE(st.st_mode):04o}: {who}",
                              path=path, fix=mode_fix)
        return os.read(fd, _MAX_KEY_FILE + 1)
    finally:
        os.close(fd)
