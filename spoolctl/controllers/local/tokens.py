"""Pure helpers of the local controllers: token prefixes, their digests, base selection.

No I/O and no framework imports. A prompt is tokenized one segment (element) at a
time and the ids concatenated, so every element boundary is also a token
boundary. ``prefix_offsets[j]`` is the token count after segment ``j`` and
``prefix_hashes[j]`` the digest of the ids before that offset (they bind an entry's
ids to its manifest). A base is shared up to the first differing id, inside a segment
too; a catalog row's ``marks`` (digests of its first 16, 32, 64, ... ids and of all
of them) let base selection rank rows without reading their manifests.
"""

from __future__ import annotations

import itertools
import json
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spoolctl.errors import ConfigError
from spoolctl.store import Hasher, hash_parts

PREFIX_SCHEMA = b"spoolctl-token-prefix/v1"
MAX_TOKEN_ID = (1 << 32) - 1


def _token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 (the digest input; platform independent)."""
    try:
        arr = array("I", tokens)
    except OverflowError:
        raise ConfigError("a token id does not fit 32 bits",
                          fix="this tokenizer is not supported by the local controllers") from None
    if arr.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte "I"
        arr = array("L", tokens)
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


@dataclass(frozen=True)
class TokenPrefix:
    """The token ids of a prompt prefix and their per-segment offsets and digests."""

    tokens: tuple[int, ...]
    offsets: tuple[int, ...]
    hashes: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.hashes):
            raise ValueError("offsets and hashes differ in length")
        if any(b < a for a, b in itertools.pairwise(self.offsets)):
            raise ValueError("offsets must not decrease")
        if self.offsets and self.offsets[-1] != len(self.tokens):
            raise ValueError("the last offset must equal the token count")

    @classmethod
    def from_segments(cls, segments: Sequence[Sequence[int]]) -> TokenPrefix:
        """Concatenate per-segment token ids and digest every segment boundary."""
        tokens: list[int] = []
        offsets: list[int] = []
        hashes: list[str] = []
        h = Hasher()
        h.update(PREFIX_SCHEMA)
        for seg in segments:
            for t in seg:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= MAX_TOKEN_ID:
                    raise ConfigError(f"invalid token id {t!r} from the tokenizer",
                                      fix="check the tokenizer of the model")
            tokens.extend(seg)
            h.update(_token_bytes(seg))
            offsets.append(len(tokens))
            hashes.append(h.hexdigest())  # blake3: hexdigest() does not finalize the state
        return cls(tuple(tokens), tuple(offsets), tuple(hashes))

    def __len__(self) -> int:
        return len(self.tokens)

    def is_prefix_of(self, tokens: Sequence[int]) -> bool:
        n = len(self.tokens)
        return len(tokens) >= n and tuple(tokens[:n]) == self.tokens

    def to_meta(self) -> dict[str, Any]:
        return {"token_count": len(self.tokens), "tokens": list(self.tokens),
                "prefix_offsets": list(self.offsets), "prefix_hashes": list(self.hashes)}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> TokenPrefix:
        """Rebuild from manifest meta, re-deriving the digests; ValueError if they disagree
        (the meta is then not trustworthy and the entry must not be used)."""
        try:
            tokens = meta["tokens"]
            offsets = meta["prefix_offsets"]
            hashes = meta["prefix_hashes"]
            count = meta["token_count"]
        except (KeyError, TypeError):
            raise ValueError("manifest meta lacks tokens or prefix offsets/hashes") from None
        if not all(isinstance(x, list) for x in (tokens, offsets, hashes)):
            raise ValueError("manifest token fields have the wrong types")
        if count != len(tokens):
            raise ValueError("token_count does not match the token ids")
        if not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets):
            raise ValueError("prefix offsets must be integers")
        bounds = [0, *offsets]
        if any(b < a for a, b in itertools.pairwise(bounds)) or \
                (offsets and offsets[-1] != len(tokens)):
            raise ValueError("prefix offsets are not increasing up to the token count")
        try:
            derived = cls.from_segments([tokens[a:b] for a, b in itertools.pairwise(bounds)])
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        if list(derived.hashes) != hashes:
            raise ValueError("prefix hashes do not match the token ids")
        return derived


def common_prefix_tokens(base: TokenPrefix, ours: TokenPrefix) -> int:
    """Leading token ids that ``base`` and ``ours`` share, wherever they stop (inside a
    segment too): a causal model's state of ids ``[0, k)`` depends on those ids alone."""
    n = min(len(base.tokens), len(ours.tokens))
    a, b = base.tokens, ours.tokens
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: halve on slices (C speed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def common_element_prefix(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


MARK_SCHEMA = b"spoolctl-token-mark/v1"
MARK_FIRST = 16
MARK_CHARS = 24


def mark_positions(count: int) -> list[int]:
    """Where an entry's catalog row records a digest of its first ids: 16, 32, 64, ...
    below its length, and its length (a few dozen bytes a doubling)."""
    out: list[int] = []
    p = MARK_FIRST
    while p < count:
        out.append(p)
        p *= 2
    if count > 0:
        out.append(count)
    return out


class PrefixDigests:
    """Digests of the first ``p`` ids of a token sequence, each computed once; ``key``
    binds them to a tenant (a keyed hash), so a row's marks are only its tenant's."""

    def __init__(self, tokens: Sequence[int], key: Callable[[str], str] | None = None):
        self._tokens = tuple(tokens)
        self._key = key
        self._memo: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    def at(self, p: int) -> str | None:
        if not 0 < p <= len(self._tokens):
            return None
        if p not in self._memo:
            digest = hash_parts(MARK_SCHEMA, _token_bytes(self._tokens[:p]))[:MARK_CHARS]
            self._memo[p] = self._key(digest) if self._key else digest
        return self._memo[p]

    def marks(self) -> dict[str, str]:
        """The catalog ``marks`` of an entry of these ids (``mark_positions``)."""
        return {str(p): self.at(p) or "" for p in mark_positions(len(self._tokens))}


def _matched_marks(marks: Any, ours: PrefixDigests) -> int | None:
    """The longest marked position whose digest equals ours (0: none); None if the row
    has no well-formed marks. Ids that differ before ``p`` differ before every later mark,
    so the scan stops at the first mismatch."""
    if not isinstance(marks, Mapping):
        return None
    try:
        points = sorted((int(p), d) for p, d in marks.items())
    except (TypeError, ValueError):
        return None
    matched = 0
    for p, digest in points:
        if not isinstance(digest, str) or ours.at(p) != digest:
            break
        matched = p
    return matched


@dataclass(frozen=True)
class BaseCandidate:
    """A retained entry that could serve as the base of an incremental prefill.
    ``shared_tokens``: the leading ids its marks confirm it shares (a lower bound);
    ``whole``: all of its ids are a prefix of the plan's."""

    entry_id: str
    key: str
    shared_elements: int
    tokens: int
    shared_tokens: int = 0
    whole: bool = False


def rank_bases(
    rows: Sequence[tuple[str, str, Mapping[str, Any]]],
    *, group: str, elements: Sequence[str], exclude: str | None = None,
    lead_segments: int = 0, prefix: PrefixDigests | None = None, whole_only: bool = False,
) -> list[BaseCandidate]:
    """Order candidate bases (``(entry_id, key, catalog index)``) best first.

    A candidate must be in the same group (model, tools, formatter, effort) and share
    leading ids its catalog ``marks`` confirm (against ``prefix``), or -- a row without
    marks -- at least one segment: one element, or the leading tools segment. More
    confirmed shared ids rank first, then more shared elements, then fewer extra tokens.
    ``whole_only`` (caches that cannot be cut back): only rows whose whole ids the marks
    confirm are a prefix of the plan's.
    """
    out: list[BaseCandidate] = []
    for entry_id, key, index in rows:
        if entry_id == exclude or not isinstance(index, Mapping) or index.get("group") != group:
            continue
        theirs = index.get("elements")
        tokens = index.get("tokens")
        if not isinstance(theirs, list) or not isinstance(tokens, int):
            continue
        shared = common_element_prefix(theirs, elements)
        matched = _matched_marks(index.get("marks"), prefix) if prefix is not None else None
        whole = matched == tokens
        if matched is not None and whole_only and not whole:
            continue  # its state is past the shared ids: never read
        if not matched and shared == 0 and lead_segments == 0:
            continue
        out.append(BaseCandidate(entry_id, key, shared, tokens, matched or 0, whole))
    out.sort(key=lambda c: (-c.shared_tokens, -c.shared_elements, c.tokens, c.entry_id))
    return out


def identity_digest(identity: Mapping[str, str]) -> str:
    """Digest of a backend identity (model, revision, dtype, device, versions)."""
    if not isinstance(identity, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in identity.items()):
        raise ConfigError("backend identity must map strings to strings",
                          fix="fix the backend's identity()")
    return hash_parts(b"spoolctl-identity/v1",
                      json.dumps(dict(identity), sort_keys=True).encode())


def namespace_for(kind: str, identity: Mapping[str, str]) -> str:
    """The store namespace of a backend: kind plus identity digest, so entries of another
    model, dtype or device are never even looked up."""
    return f"{kind}-{identity_digest(identity)[:32]}"
