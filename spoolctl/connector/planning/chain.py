"""Chunk-chain keys for prompt prefixes (pure; no I/O, no frameworks).

A prompt is cut into chunks of ``chunk_tokens`` tokens. Chunk ``i`` is named by
``h_i = H(h_{i-1}, tokens of chunk i, multimodal features overlapping chunk i)``
with ``h_{-1} = H(schema, deployment namespace, cache_salt)``. Two prompts that
share their first k chunks (and salt, and deployment) therefore share exactly
their first k keys, and a key can never be reused across salts or deployments.
Only complete chunks get keys: a partial tail is never stored.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from spoolctl.store import hash_parts

SCHEMA = b"spoolctl-vllm-chain/v1"


@dataclass(frozen=True)
class MMSpan:
    """A multimodal item: its content identity (vLLM's feature hash), modality and the
    prompt positions its placeholder occupies. All of it is part of the chunk chain."""

    identifier: str
    offset: int
    length: int
    modality: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str) or not self.identifier:
            raise ValueError("multimodal identifier must be a non-empty string")
        if self.offset < 0 or self.length < 0:
            raise ValueError("multimodal span must have a non-negative offset and length")

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.offset + self.length

    def encode(self) -> bytes:
        # Modality last and only when known, so text-only and older keys are unchanged.
        tail = f":{self.modality}" if self.modality else ""
        return f"{self.offset}:{self.length}:{self.identifier}{tail}".encode()


def _token_bytes(tokens: Sequence[int]) -> bytes:
    # Little-endian int64 on every host, so keys agree across machines.
    arr = array("q", tokens)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def chain_root(namespace: str, cache_salt: str | None, adapter: str | None = None) -> str:
    """The seed of a request's chain: binds the deployment, the cache salt and, for a LoRA
    request, its adapter's content digest (requests without one keep their keys)."""
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode()
    if adapter is None:
        return hash_parts(SCHEMA, namespace.encode(), salt)
    return hash_parts(SCHEMA, namespace.encode(), salt, b"lora:" + adapter.encode())


def chunk_keys(
    root: str,
    token_ids: Sequence[int],
    chunk_tokens: int,
    mm_spans: Sequence[MMSpan] = (),
) -> list[str]:
    """Keys of every complete chunk of ``token_ids`` (64-hex strings, in order)."""
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    keys: list[str] = []
    prev = root
    for i in range(len(token_ids) // chunk_tokens):
        start, end = i * chunk_tokens, (i + 1) * chunk_tokens
        mm = b"".join(s.encode() + b"\x00" for s in mm_spans if s.overlaps(start, end))
        prev = hash_parts(prev.encode(), _token_bytes(token_ids[start:end]), mm)
        keys.append(prev)
    return keys


def longest_run(flags: Sequence[bool]) -> int:
    """Length of the run of True values at the start of ``flags``."""
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n
