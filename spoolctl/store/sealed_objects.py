"""Sealed (AES-256-GCM) objects, each bound to its place in the store: the header format,
what the GCM tag authenticates, and the one-pass encryption and decryption of an object
(``sealing.Sealer`` drives them with the keys of its keyring).

A sealed object is ``HEADER | ciphertext | tag``. The header (SPS3) is ``MAGIC3 | tenant id
(8 bytes) | key version (u64) | nonce``; the tag authenticates the header *and* the object's
``Binding``: the id of the entry it belongs to (which names the tenant: its key is the
tenant's keyed hash) and its name in that entry (its role: key or value tensors, the sealed
token meta). An object copied to another entry, tenant or role fails its tag. The reader
builds the binding from what it asked for, never from the object's own bytes.

SPS1 / SPS2 objects (written before the binding) bind nothing but their header: they are
never opened (a miss, ``LegacySealError``), and their entries are written again.
"""

from __future__ import annotations

import os
import secrets
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CorruptionError, KeyUnavailableError, QuarantineReason
from .disk.fsio import SpecialFileError, advise_willneed, open_for_read
from .disk.verify import HASH_POOL, INLINE_HASH_MAX, PIPE_CHUNK, read_exactly

MAGIC = b"SPS1"
MAGIC2 = b"SPS2"
MAGIC3 = b"SPS3"
NONCE_BYTES = 12
TAG_BYTES = 16
# MAGIC | tenant id (8 bytes) | key version (u32, big endian) | nonce: objects of keys made
# before random key ids, whose versions were counted per keyring (1, 2, ...). Read: never.
_HEADER = struct.Struct(">4s8sI12s")
HEADER_BYTES = _HEADER.size
# MAGIC2 / MAGIC3 | tenant id | key version (u64) | nonce. SPS3 adds the binding to the tag.
_HEADER2 = struct.Struct(">4s8sQ12s")
BOUND_HEADER_BYTES = _HEADER2.size
OVERHEAD = BOUND_HEADER_BYTES + TAG_BYTES
# Versions at or above this are random key ids; below it, legacy counters.
WIDE_VERSION = 1 << 32
# Plaintext per encrypted piece of a commit (``SealedStream``): small enough to stay in cache.
SEAL_CHUNK = 1 << 20
BytesLike = bytes | bytearray | memoryview
_BIND_LABEL = b"spoolctl-sealed-object/v3\0"


@dataclass(frozen=True)
class Binding:
    """Where a sealed object belongs: object ``name`` of entry ``entry_id`` (64 hex), sealed
    under key ``version`` of tenant ``tid`` (16 hex). Authenticated by the object's tag."""

    entry_id: str
    name: str
    tid: str
    version: int

    def aad(self, header: BytesLike) -> bytes:
        """What the tag authenticates besides the ciphertext: the header, then the entry id
        and the object's name (length-prefixed: names are at most 128 ASCII bytes)."""
        name = self.name.encode()
        return bytes(header) + _BIND_LABEL + bytes.fromhex(self.entry_id) + \
            len(name).to_bytes(2, "big") + name


class LegacySealError(KeyUnavailableError):
    """An object sealed before objects were bound to their entry (SPS1/SPS2): never opened,
    since nothing in it says which entry, tenant or role it belongs to. A miss; ``erased``
    so the store releases the entry and its next commit writes it again, bound."""


def legacy_refusal(path: Path | None) -> LegacySealError:
    return LegacySealError(
        "sealed by an older spoolctl, not bound to its entry: not opened (a miss; the entry "
        "is written again at its next commit)", path=path,
        fix="nothing to do: `spoolctl clean --released` reclaims such entries", erased=True)


def pack_header(binding: Binding) -> bytes:
    """A fresh SPS3 header (random nonce) for ``binding``."""
    return _HEADER2.pack(MAGIC3, bytes.fromhex(binding.tid), binding.version,
                         secrets.token_bytes(NONCE_BYTES))


def check_header(header: BytesLike, binding: Binding, path: Path | None) -> bytes:
    """The nonce of the SPS3 ``header`` if it names ``binding``'s tenant and key version;
    LegacySealError for an SPS1/SPS2 header, CorruptionError for anything else (an object
    of another tenant or key, or no sealed object)."""
    magic = bytes(header[:4])
    if magic in (MAGIC, MAGIC2):
        raise CorruptionError("a sealed object of an older format in an entry of this one",
                              reason=QuarantineReason.PAYLOAD_DIGEST, path=path)
    if magic != MAGIC3 or len(header) != BOUND_HEADER_BYTES:
        raise CorruptionError("object is not sealed (bad header)",
                              reason=QuarantineReason.PAYLOAD_DIGEST, path=path)
    _, tid_raw, version, nonce = _HEADER2.unpack_from(header)
    if tid_raw.hex() != binding.tid or version != binding.version:
        raise CorruptionError("sealed object of another tenant or key than its entry's",
                              reason=QuarantineReason.PAYLOAD_DIGEST, path=path)
    return bytes(nonce)


def tag_failed(path: Path | None) -> CorruptionError:
    return CorruptionError("sealed object failed authentication (tag mismatch: damaged, or "
                           "moved from another entry, tenant or role)",
                           reason=QuarantineReason.PAYLOAD_DIGEST, path=path)


def decryptor(lib: Any, key: bytes, header: BytesLike, binding: Binding,
              path: Path | None) -> Any:
    """A GCM decryptor for the object with SPS3 ``header`` at ``binding`` (tag given at the
    end); errors as ``check_header``."""
    nonce = check_header(header, binding, path)
    dec = lib.Cipher(lib.algorithms.AES(key), lib.modes.GCM(nonce)).decryptor()
    dec.authenticate_additional_data(binding.aad(header))
    return dec


def encryptor(lib: Any, key: bytes, header: bytes, binding: Binding) -> Any:
    enc = lib.Cipher(lib.algorithms.AES(key), lib.modes.GCM(header[-NONCE_BYTES:])).encryptor()
    enc.authenticate_additional_data(binding.aad(header))
    return enc


def seal(lib: Any, key: bytes, binding: Binding, payload: BytesLike) -> memoryview:
    """``payload`` sealed under ``key`` at ``binding``, in one buffer."""
    data = memoryview(payload).cast("B")
    n = len(data)
    header = pack_header(binding)
    hb = len(header)
    enc = encryptor(lib, key, header, binding)
    out = bytearray(hb + n + 15 + TAG_BYTES)  # update_into wants a block spare
    view = memoryview(out)
    view[:hb] = header
    done = enc.update_into(data, view[hb:]) if n else 0
    enc.finalize()
    view[hb + done:hb + done + TAG_BYTES] = enc.tag
    return view[:hb + n + TAG_BYTES]


def open_file(lib: Any, key_of: Any, path: Path, size: int, binding: Binding,
              into: memoryview | None) -> memoryview:
    """Read the sealed object at ``path`` (``size`` bytes) bound to ``binding`` and return
    its plaintext, in one pass (see ``Sealer.open``). ``key_of(binding)``: its data key, or
    raises KeyUnavailableError; called after the header checked out."""
    try:
        fd = open_for_read(path)
    except SpecialFileError as exc:
        raise CorruptionError(f"object is not a regular file ({exc.kind})",
                              reason=QuarantineReason.PAYLOAD_MISSING, path=path) from None
    try:
        if os.fstat(fd).st_size != size or size < OVERHEAD:
            raise CorruptionError(f"sealed object is not {size} bytes",
                                  reason=QuarantineReason.PAYLOAD_SIZE, path=path)
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            header = _read_exactly(f, memoryview(bytearray(BOUND_HEADER_BYTES)), path)
            check_header(header, binding, path)
            dec = decryptor(lib, key_of(binding), header, binding, path)
            n = size - OVERHEAD
            pipelined = n > INLINE_HASH_MAX
            if pipelined:
                advise_willneed(fd)  # the whole object: readahead beyond one chunk
            out = into if into is not None else memoryview(bytearray(n))
            if len(out) != n:
                raise ValueError("destination buffer has the wrong size")
            try:
                _decrypt_stream(f, dec, out, pipelined, path)
                tag = bytes(_read_exactly(f, memoryview(bytearray(TAG_BYTES)), path))
                if f.read(1):
                    raise CorruptionError("sealed object grew while reading",
                                          reason=QuarantineReason.PAYLOAD_SIZE, path=path)
                dec.finalize_with_tag(tag)
            except BaseException as exc:
                out[:] = bytes(n)  # nothing unauthenticated is left in the buffer
                if isinstance(exc, lib.InvalidTag):
                    raise tag_failed(path) from None
                raise
    finally:
        os.close(fd)
    return out


def unseal(lib: Any, key_of: Any, sealed: memoryview, binding: Binding,
           into: memoryview | None, path: Path | None) -> memoryview:
    """The plaintext of the sealed bytes ``sealed`` bound to ``binding`` (see ``open_file``)."""
    hb = BOUND_HEADER_BYTES
    if len(sealed) < hb + TAG_BYTES:
        raise CorruptionError("sealed object too short", reason=QuarantineReason.PAYLOAD_SIZE,
                              path=path)
    check_header(sealed[:hb], binding, path)
    dec = decryptor(lib, key_of(binding), sealed[:hb], binding, path)
    n = len(sealed) - hb - TAG_BYTES
    out = into if into is not None else memoryview(bytearray(n))
    if len(out) != n:
        raise ValueError("destination buffer has the wrong size")
    tag = bytes(sealed[len(sealed) - TAG_BYTES:])
    body = sealed[hb:hb + n]
    # update_into wants 15 spare bytes after the output: decrypt all but the last 32
    # bytes straight into ``out``, the tail through a small copy.
    head = max(0, n - 32)
    try:
        if head:
            dec.update_into(body[:head], out)
        out[head:n] = dec.update(body[head:])
        dec.finalize_with_tag(tag)
    except lib.InvalidTag:
        if into is not None:
            into[:] = bytes(n)  # nothing unauthenticated is left in the caller's buffer
        raise tag_failed(path) from None
    return out


def _read_exactly(f: Any, window: memoryview, path: Path) -> memoryview:
    return read_exactly(f, window, path, "sealed object shorter than its size")


def _decrypt_stream(f: Any, dec: Any, out: memoryview, pipelined: bool, path: Path) -> None:
    """Read ``len(out)`` ciphertext bytes from ``f`` in ``PIPE_CHUNK`` pieces and decrypt them
    into ``out``. Pipelined: two scratch buffers, chunk i decrypted on the hash pool while
    chunk i+1 is read (the read releases the GIL), in order (GCM is one stream)."""
    n = len(out)
    scratch = [memoryview(bytearray(min(PIPE_CHUNK, n))) for _ in range(2 if pipelined else 1)]
    pending: Future[None] | None = None
    offset = turn = 0
    try:
        while offset < n:
            end = min(offset + PIPE_CHUNK, n)
            window = _read_exactly(f, scratch[turn][:end - offset], path)
            if pending is not None:
                done, pending = pending, None
                done.result()
            if pipelined:
                pending = HASH_POOL.submit(_decrypt_into, dec, window, out, offset)
                turn ^= 1
            else:
                _decrypt_into(dec, window, out, offset)
            offset = end
    finally:
        if pending is not None:  # never leave the helper writing into ``out``
            pending.result()


def _decrypt_into(dec: Any, chunk: memoryview, out: memoryview, offset: int) -> None:
    """Decrypt ``chunk`` into ``out`` at ``offset``. ``update_into`` wants a block's worth of
    room past the output: the last bytes of the buffer go through a small copy."""
    k = len(chunk)
    head = k if len(out) - offset - k >= 16 else max(0, k - 32)
    if head:
        dec.update_into(chunk[:head], out[offset:])
    if head < k:
        out[offset + head:offset + k] = dec.update(chunk[head:])


# Per thread: the two chunk buffers of the ``SealedStream`` it is writing (2 MiB, kept).
_SCRATCH = threading.local()


class SealedStream:
    """One sealed object, encrypted as the commit writes it: its header, the ciphertext in
    ``SEAL_CHUNK`` pieces, the tag (``seal``'s bytes).

    ``transient``: each chunk is one of two buffers used in turn, valid until the chunk
    after next is asked for (``fsio.write_tmp_flushing`` writes it at once and hashes it on
    the hash pool while the next one is encrypted, both in the CPU cache). No buffer of the
    object's size is made: sealing 64 MiB into fresh memory cost 2-3x the encryption
    itself here (page faults; docs/benchmarks.md). Encrypting on a helper thread instead
    was slower on this 2-core host (hand-offs under load). ``size``: the bytes it yields;
    ``replayable``: iterable again (a commit retried after a catalog repair), the same
    bytes each time."""

    transient = True
    replayable = True

    def __init__(self, lib: Any, key: bytes, binding: Binding, payload: BytesLike):
        self._lib, self._key, self._binding = lib, key, binding
        self._header = pack_header(binding)
        self._data = memoryview(payload).cast("B")
        self.size = len(self._header) + len(self._data) + TAG_BYTES

    def __iter__(self) -> Iterator[memoryview | bytes]:
        data = self._data
        n = len(data)
        enc = encryptor(self._lib, self._key, self._header, self._binding)
        yield self._header
        # two buffers in turn (the writer hashes one while this fills the other), this
        # thread's own when free: two fresh 1 MiB buffers cost more than sealing 1 MiB
        # (1.6-1.9 ms of page faults against ~0.5 ms here)
        own = n > 0 and not getattr(_SCRATCH, "busy", False)
        if own:
            _SCRATCH.busy = True
            bufs = getattr(_SCRATCH, "bufs", None)
            if bufs is None:  # update_into wants a block's worth of room past its output
                bufs = _SCRATCH.bufs = [memoryview(bytearray(SEAL_CHUNK + 16)) for _ in range(2)]
        else:
            bufs = [memoryview(bytearray(min(SEAL_CHUNK, n) + 16)) for _ in range(2)]
        try:
            for i, at in enumerate(range(0, n, SEAL_CHUNK)):
                buf = bufs[i % 2]
                yield buf[:enc.update_into(data[at:at + SEAL_CHUNK], buf)]
        finally:
            if own:
                _SCRATCH.busy = False
        enc.finalize()
        yield enc.tag
