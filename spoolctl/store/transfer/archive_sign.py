"""Archives that prove their author: an Ed25519 signature over an export archive.

``<archive>.sig`` is a JSON document: the BLAKE3 digest of every byte of the archive and an
Ed25519 signature over it. Importers hold only the public key, so they cannot forge one.
A stream carries the same document in a ``TRAILER_BYTES`` trailer after the tar's end
padding. Both are verified on a private copy before anything is imported, so the bytes
imported are the bytes verified. Keys are PEM files; the private one must be mode 0600.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import blake3

from ...errors import ArchiveError, ConfigError
from .archive import TRAILER_BYTES, TRAILER_MAGIC

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

SCHEMA = "spoolctl-archive-sig/v1"
ALGORITHM = "ed25519"
_CONTEXT = b"spoolctl-archive-sig/v1\x00"
_CHUNK = 1 << 20
_MAX_KEY = 16 << 10
_MAX_SIG = 64 << 10


def sig_path(archive: Path) -> Path:
    return archive.with_name(archive.name + ".sig")


def _read_key_file(path: Path, *, private: bool) -> bytes:
    what = "signing key" if private else "verify key"
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ConfigError(f"the {what} file cannot be read ({os.strerror(exc.errno or 0)})",
                          path=path, fix="pass the PEM file (not a symlink), readable by "
                                         "this user") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"the {what} file is not a regular file", path=path,
                              fix="pass the PEM file itself")
        if private and st.st_mode & 0o077:
            raise ConfigError(f"the signing key file has mode {stat.S_IMODE(st.st_mode):04o}",
                              path=path, fix=f"chmod 600 {path}")
        return os.read(fd, _MAX_KEY)
    finally:
        os.close(fd)


def _lib() -> Any:  # the optional `cryptography` modules, imported on first use
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise ConfigError("signed archives need the `cryptography` package",
                          fix="pip install 'spoolctl[crypto]'") from None
    return InvalidSignature, serialization, ed25519


def _raw_public(public: Ed25519PublicKey) -> bytes:
    _, serialization, _ = _lib()
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public: Ed25519PublicKey) -> str:
    return blake3.blake3(b"spoolctl-fleet-key/v1" + _raw_public(public)).hexdigest()[:16]


def load_signing_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    _, serialization, _ = _lib()
    from cryptography.hazmat.primitives.asymmetric import ed25519
    path = Path(path)
    try:
        key = serialization.load_pem_private_key(_read_key_file(path, private=True), None)
    except (ValueError, TypeError):
        key = None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ConfigError("the signing key file is not an Ed25519 private key (PEM)", path=path,
                          fix="make one: openssl genpkey -algorithm ed25519 -out fleet.key")
    return key


def load_verify_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    _, serialization, _ = _lib()
    from cryptography.hazmat.primitives.asymmetric import ed25519
    path = Path(path)
    try:
        key = serialization.load_pem_public_key(_read_key_file(path, private=False))
    except (ValueError, TypeError):
        key = None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise ConfigError("the verify key file is not an Ed25519 public key (PEM)", path=path,
                          fix="make it from the signing key: openssl pkey -in fleet.key -pubout")
    return key


def _digest_file(path: Path, copy_to: int | None = None) -> str:
    hasher = blake3.blake3()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)
            if copy_to is not None:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(copy_to, view):]
    return hasher.hexdigest()


def _signature_doc(key: Ed25519PrivateKey, digest: str) -> dict[str, Any]:
    return {"schema": SCHEMA, "alg": ALGORITHM, "key_id": key_id(key.public_key()),
            "blake3": digest, "signature": key.sign(_CONTEXT + digest.encode()).hex()}


def sign_archive(archive: Path, key: Ed25519PrivateKey) -> Path:
    """Write ``<archive>.sig`` for the finished archive file ``archive``; returns its path."""
    doc = _signature_doc(key, _digest_file(archive))
    out = sig_path(archive)
    tmp = out.with_name(out.name + ".part")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, out)
    return out


class SigningSink:
    """A sink (``FdSink``'s contract) that hashes every byte it passes on; ``trailer(key)``
    is the signature block to write after the archive's last byte."""

    def __init__(self, inner: Callable[[list[bytes | memoryview]], None]):
        self._inner = inner
        self._hasher = blake3.blake3()

    def __call__(self, bufs: list[bytes | memoryview]) -> None:
        for b in bufs:
            self._hasher.update(b)
        self._inner(bufs)

    def trailer(self, key: Ed25519PrivateKey) -> bytes:
        body = TRAILER_MAGIC + json.dumps(_signature_doc(key, self._hasher.hexdigest()),
                                          sort_keys=True).encode()
        assert len(body) <= TRAILER_BYTES
        return body + b" " * (TRAILER_BYTES - len(body))


def _check_signature(doc: Any, public: Ed25519PublicKey, where: str | Path) -> str:
    """The signed digest of a signature document ``doc`` that verifies under ``public``;
    ArchiveError (one line) otherwise."""
    invalid, _, _ = _lib()
    try:
        if doc.get("schema") != SCHEMA or doc.get("alg") != ALGORITHM:
            raise ValueError
        digest, signature = str(doc["blake3"]), bytes.fromhex(str(doc["signature"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ArchiveError("the archive's signature is malformed", path=where,
                           fix="export the archive again with --sign-key") from None
    if doc.get("key_id") != key_id(public):
        raise ArchiveError(f"the archive is signed by another key ({str(doc.get('key_id'))[:16]}"
                           f"; this verify key is {key_id(public)})", path=where,
                           fix="import only archives signed by your fleet's key")
    try:
        public.verify(signature, _CONTEXT + digest.encode())
    except invalid:
        raise ArchiveError("the archive's signature does not verify (forged)", path=where,
                           fix="do not import it; find who wrote it") from None
    return digest


class Readable(Protocol):
    """A binary stream read in chunks."""

    def read(self, size: int = -1, /) -> bytes: ...


@contextlib.contextmanager
def verified_stream_copy(stream: Readable, public: Ed25519PublicKey) -> Iterator[Path]:
    """A private copy of the signed stream ``stream``, without its trailer, whose signature
    verifies under ``public``; ArchiveError (nothing imported) for an unsigned or cut-short
    stream, a malformed, forged or foreign signature, or bytes changed after signing. The
    copy is removed on exit."""
    with tempfile.TemporaryDirectory(prefix="spoolctl-import-") as tmp:
        copy = Path(tmp) / "archive.tar"
        fd = os.open(copy, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            hasher, held, total = blake3.blake3(), b"", 0
            while chunk := stream.read(_CHUNK):
                held += chunk
                if len(held) > TRAILER_BYTES:  # all but the last TRAILER_BYTES are signed
                    hasher.update(held[:-TRAILER_BYTES])
                    held = held[-TRAILER_BYTES:]
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
                total += len(chunk)
            if len(held) != TRAILER_BYTES or not held.startswith(TRAILER_MAGIC):
                raise ArchiveError("the stream is not signed (no signature at its end: "
                                   "unsigned, or cut short)", path="-",
                                   fix="export it with --sign-key; if it was cut short, "
                                       "export and import again")
            try:
                doc = json.loads(held[len(TRAILER_MAGIC):].rstrip(b" "))
            except ValueError:
                doc = None
            digest = _check_signature(doc, public, "-")
            if hasher.hexdigest() != digest:
                raise ArchiveError("the archive's bytes are not the ones signed (altered "
                                   "after signing)", path="-",
                                   fix="do not import it; export it again")
            os.ftruncate(fd, total - TRAILER_BYTES)
        finally:
            os.close(fd)
        yield copy


@contextlib.contextmanager
def verified_copy(archive: Path, public: Ed25519PublicKey) -> Iterator[Path]:
    """A private copy of ``archive`` whose signature ``<archive>.sig`` verifies under
    ``public``; ArchiveError (one line, nothing imported) for a missing, malformed, forged or
    foreign signature. The copy is removed on exit."""
    _lib()
    sig = sig_path(archive)
    try:
        raw = sig.read_bytes()[:_MAX_SIG + 1]
    except FileNotFoundError:
        raise ArchiveError("the archive is not signed (no .sig next to it)", path=archive,
                           fix="export it with --sign-key, or import without --require-signed"
                               " if you vouch for it") from None
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    digest = _check_signature(doc, public, sig)
    with tempfile.TemporaryDirectory(prefix="spoolctl-import-") as tmp:
        copy = Path(tmp) / "archive.tar"
        fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            actual = _digest_file(archive, copy_to=fd)
        finally:
            os.close(fd)
        if actual != digest:
            raise ArchiveError("the archive's bytes are not the ones signed (altered after "
                               "signing)", path=archive, fix="do not import it; export it again")
        yield copy
