"""Ed25519 fleet key pairs for the signed-archive tests (decision 2800): the private key as
PKCS#8 PEM (0600), the public key as SubjectPublicKeyInfo PEM, the way an operator makes
them with `openssl genpkey -algorithm ed25519`. Needs ``cryptography``."""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


def keypair(where: Path, name: str) -> tuple[Path, Path, Ed25519PrivateKey]:
    """``where/<name>.key`` and ``where/<name>.pub`` of a new key pair, and the key."""
    key = Ed25519PrivateKey.generate()
    private, public = where / f"{name}.key", where / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    private.chmod(0o600)
    public.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public, key
