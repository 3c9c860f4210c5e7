"""KV events for cache-aware routers: what the spool tier offers, in vLLM's block hashes (pure).

Routers learn which replica holds which prefix from vLLM's KV cache events; the scheduler
publishes the spool tier's part of that stream (``kvevents`` turns the records below into
vLLM's ``BlockStored`` / ``BlockRemoved`` with ``medium="STORAGE"``):

* a chunk is announced (``Stored``) once **every** rank holds it (the quorum a lookup uses:
  a router must not route to a replica that cannot restore), and withdrawn (``Removed``)
  as soon as any rank stops holding it (evicted, cleaned, quarantined, failed to read,
  dropped to keep the ranks in step);
* at startup, everything the rank stores already hold is announced, before any request
  (the connector keeps vLLM's engine loop stepping until it is out).

A chunk is named by the vLLM block hashes of its blocks (``Request.block_hashes``) and
the hash of the block before it: taken from the request at lookup (``HashBook``) and kept
in the chunk's manifest index (``ChunkHashes.to_index``) so a restarted replica can
announce its disk contents. The record carries a fingerprint of vLLM's hash function and
seed (``kvevents.hash_identity``); a record from another fingerprint is never announced.

Events never carry prompt text: no token ids, no salts, no extra keys.

``EventLedger`` is driven by the inventory protocol (``inventory.Applied``: what each rank
reported) and by lookups; it decides *when* to announce what. Not thread-safe (vLLM's
scheduler is single-threaded).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .inventory import Applied

# The manifest index field holding a chunk's vLLM block hashes.
INDEX_FIELD = "vllm_block_hashes"
# Chunks whose hashes are remembered between a lookup and the chunk's commit on every rank
# (~1.2 KiB each with 16 blocks of sha256 per chunk; a chunk forgotten here is resolved from
# its manifest instead).
HASHBOOK_ENTRIES = 8192
# Chunks announced at most: their block hashes are kept (packed, ~0.7 KiB each with 16 blocks
# of sha256) to withdraw them later. Beyond it chunks are simply not announced: a router then
# routes as if they were not on disk.
MAX_ADVERTISED = 1 << 16
_MAX_HASH_BYTES = 64
_HEX = re.compile(r"^[0-9a-f]{2,128}$")


@dataclass(frozen=True)
class ChunkHashes:
    """One chunk in vLLM's terms: its blocks' hashes and the hash of the block before it
    (None for a prompt's first chunk). Hashes are raw bytes as vLLM computes them."""

    parent: bytes | None
    blocks: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("a chunk has at least one block")
        for h in (*self.blocks, *(() if self.parent is None else (self.parent,))):
            if not isinstance(h, bytes) or not 0 < len(h) <= _MAX_HASH_BYTES:
                raise ValueError("block hashes are 1..64 bytes")

    def to_index(self, identity: str) -> dict[str, Any]:
        """The manifest index record (hashes only), bound to the hash ``identity``."""
        return {INDEX_FIELD: {"id": identity,
                              "parent": None if self.parent is None else self.parent.hex(),
                              "blocks": [h.hex() for h in self.blocks]}}

    @classmethod
    def from_index(cls, index: Mapping[str, Any], identity: str) -> ChunkHashes | None:
        """The hashes recorded in a manifest index, or None when there are none, they are
        malformed, or they were computed under another hash identity."""
        doc = index.get(INDEX_FIELD) if isinstance(index, Mapping) else None
        if not isinstance(doc, Mapping) or doc.get("id") != identity:
            return None
        parent, blocks = doc.get("parent"), doc.get("blocks")
        if not isinstance(blocks, list) or not blocks or \
                not all(isinstance(b, str) and _HEX.match(b) for b in blocks):
            return None
        if parent is not None and not (isinstance(parent, str) and _HEX.match(parent)):
            return None
        try:
            return cls(None if parent is None else bytes.fromhex(parent),
                       tuple(bytes.fromhex(b) for b in blocks))
        except ValueError:
            return None


def chunk_hashes(block_hashes: Sequence[bytes], n_chunks: int,
                 per_chunk: int) -> list[ChunkHashes | None]:
    """Each of a prompt's first ``n_chunks`` chunks in vLLM's block hashes (``per_chunk``
    hashes each), None for a chunk the request has no complete hashes for."""
    if per_chunk <= 0:
        raise ValueError("per_chunk must be positive")
    out: list[ChunkHashes | None] = []
    for i in range(n_chunks):
        lo, hi = i * per_chunk, (i + 1) * per_chunk
        blocks = tuple(block_hashes[lo:hi])
        parent = block_hashes[lo - 1] if 0 < lo <= len(block_hashes) else None
        if len(blocks) != per_chunk or not all(isinstance(b, bytes) and b for b in blocks) \
                or (lo > 0 and not (isinstance(parent, bytes) and parent)):
            out.append(None)
            continue
        out.append(ChunkHashes(parent, blocks))
    return out


class HashBook:
    """Chunk key -> ``ChunkHashes`` for chunks seen at lookup, least recently noted dropped
    first beyond ``capacity`` (a dropped chunk is resolved from its manifest instead)."""

    def __init__(self, capacity: int = HASHBOOK_ENTRIES):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self._capacity = capacity
        self._book: OrderedDict[bytes, ChunkHashes] = OrderedDict()

    def note(self, key: bytes, hashes: ChunkHashes) -> None:
        self._book[key] = hashes
        self._book.move_to_end(key)
        while len(self._book) > self._capacity:
            self._book.popitem(last=False)

    def get(self, key: bytes) -> ChunkHashes | None:
        return self._book.get(key)

    def __len__(self) -> int:
        return len(self._book)


@dataclass(frozen=True)
class Stored:
    """Announce ``key``'s blocks as held by this replica's spool tier."""

    key: bytes
    hashes: ChunkHashes


@dataclass(frozen=True)
class Removed:
    """Withdraw ``key``'s blocks."""

    key: bytes
    hashes: ChunkHashes


class QuorumView(Protocol):
    """What the ledger asks of the inventory view (``inventory.InventoryView``)."""

    def has_all(self, key: bytes) -> bool: ...

    def holds(self, rank: int, key: bytes) -> bool: ...

    def settled(self, rank: int) -> bool: ...


# Resolves chunk keys to their hashes from the stores (manifest index); returns what it found.
Resolver = Callable[[list[bytes]], Mapping[bytes, ChunkHashes]]


class EventLedger:
    """Decides what to announce (see the module docstring).

    Inputs: ``applied`` (what the ranks reported), ``seen`` (a lookup found chunks present
    on every rank: announce them if they were not, e.g. stored before hashes were recorded).
    ``take`` returns the events due, resolving hashes from the ``HashBook`` first and the
    stores (``resolve``) second; a chunk whose hashes cannot be found is not announced and
    is counted in ``unresolved``.
    """

    def __init__(self, book: HashBook, *, max_advertised: int = MAX_ADVERTISED):
        self._book = book
        self._max = max_advertised
        self._advertised: dict[bytes, bytes] = {}  # key -> packed block hashes
        self._candidates: dict[bytes, None] = {}  # insertion-ordered set
        self._removed: dict[bytes, None] = {}
        self._reconcile: set[int] = set()  # ranks to compare with once they are settled
        self.unresolved = 0
        self.over_limit = 0

    @property
    def advertised(self) -> int:
        return len(self._advertised)

    def is_advertised(self, key: bytes) -> bool:
        return key in self._advertised

    def applied(self, changes: Iterable[Applied]) -> None:
        """Ranks' applied inventory reports (``InventoryView.apply``)."""
        for change in changes:
            if change.kind == "delta":
                for key in change.removed:
                    self._removed[key] = None
                    self._candidates.pop(key, None)
                for key in change.added:
                    self._candidates[key] = None
            elif change.kind == "reset":
                # The rank restated its inventory (possibly over several reports): what it
                # no longer holds is found once it has finished (``settled``).
                self._reconcile.add(change.rank)
                for key in change.added:
                    self._candidates[key] = None
            elif change.kind == "forgotten":
                self._reconcile.add(change.rank)

    def seen(self, keys: Iterable[bytes]) -> None:
        """Chunks a lookup found on every rank."""
        for key in keys:
            if key not in self._advertised:
                self._candidates[key] = None

    @property
    def pending(self) -> bool:
        """Whether ``take`` has something to consider."""
        return bool(self._candidates or self._removed or self._reconcile)

    def take(self, view: QuorumView, resolve: Resolver) -> list[Stored | Removed]:
        """The events due now, removals first."""
        out: list[Stored | Removed] = []
        removed, self._removed = self._removed, {}
        for key in removed:
            if key in self._advertised and not view.has_all(key):
                out.append(Removed(key, _unpack(self._advertised.pop(key))))
        for rank in [r for r in self._reconcile if view.settled(r)]:
            self._reconcile.discard(rank)
            for key in [k for k in self._advertised if not view.holds(rank, k)]:
                out.append(Removed(key, _unpack(self._advertised.pop(key))))
        candidates, self._candidates = self._candidates, {}
        due = [k for k in candidates if k not in self._advertised and view.has_all(k)]
        known = {k: h for k in due if (h := self._book.get(k)) is not None}
        missing = [k for k in due if k not in known]
        if missing:
            known.update(resolve(missing))
        stored = []
        for key in due:
            hashes = known.get(key)
            if hashes is None:
                self.unresolved += 1
                continue
            if len(self._advertised) >= self._max:
                self.over_limit += 1
                continue
            self._advertised[key] = _pack(hashes)
            stored.append(Stored(key, hashes))
        return out + parents_first(stored)


def _pack(hashes: ChunkHashes) -> bytes:
    """A chunk's block hashes in one bytes object (what a removal needs; no parent)."""
    sizes = {len(b) for b in hashes.blocks}
    if len(sizes) == 1:
        return bytes([sizes.pop()]) + b"".join(hashes.blocks)
    return b"\x00" + b"".join(bytes([len(b)]) + b for b in hashes.blocks)


def _unpack(packed: bytes) -> ChunkHashes:
    size, body = packed[0], packed[1:]
    if size:
        return ChunkHashes(None, tuple(body[i:i + size] for i in range(0, len(body), size)))
    blocks, i = [], 0
    while i < len(body):
        blocks.append(body[i + 1:i + 1 + body[i]])
        i += 1 + body[i]
    return ChunkHashes(None, tuple(blocks))


def parents_first(records: list[Stored]) -> list[Stored]:
    """``records`` ordered so that a chunk comes after the chunk whose last block is its
    parent (routers that keep a prefix tree drop a block whose parent they do not know)."""
    by_last = {r.hashes.blocks[-1]: r for r in records}
    depth: dict[bytes, int] = {}

    for rec in records:
        chain: list[Stored] = []  # walk up to a chunk of known depth, or a root
        seen: set[bytes] = set()
        while rec.key not in depth and rec.key not in seen:
            chain.append(rec)
            seen.add(rec.key)
            parent = by_last.get(rec.hashes.parent) if rec.hashes.parent is not None else None
            if parent is None:
                break
            rec = parent
        base = depth.get(rec.key, -1) if rec.key not in seen else -1
        for r in reversed(chain):
            base += 1
            depth[r.key] = base
    return sorted(records, key=lambda r: depth[r.key])
