"""What the model's weights are: a content digest cheap enough for every engine start.

``weights_digest(model_dir)`` names the bytes of every file in a model directory (weights,
config, tokenizer: all of them shape what a KV block holds). It is bound into the deployment
identity (``identity``), so an engine whose weights changed at the same path starts a new,
empty namespace instead of restoring KV another model computed.

Per file, cheapest proof first:

* **Hugging Face hub cache.** A snapshot file is a symlink to ``models--*/blobs/<name>``
  whose name is the file's content hash on the hub (SHA-256 for LFS files, the git blob
  SHA-1 for small ones). That name is the digest: nothing is read.
* **Remembered.** Any other file is hashed (BLAKE3) once; its digest is remembered with the
  file's identity ``(device, inode, size, mtime_ns, ctime_ns)`` in a small per-user memo
  (``memo_dir``). While all five are unchanged the memo is used; a file rewritten in place,
  replaced by a rename, copied over (even with ``cp -p``: the ctime changes) or touched is
  hashed again in full.

The memo is trusted only because nobody but this user (and root) can write it: its directory
and files must be owned by the effective user and not writable by group or others, else it
is ignored (every start hashes in full, with a warning). It never lives in a store: a store
may be shared with writers who must not be able to vouch for weights.

Concurrent ranks of one deployment take one lock per model directory, so a model is hashed
once per host, not once per rank.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spoolctl.errors import ConfigError
from spoolctl.store import Hasher, hash_bytes, hash_parts

log = logging.getLogger("spoolctl.connector")

MEMO_VERSION = 1
_HUB_BLOB = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_BLOCK = 8 << 20


@dataclass(frozen=True)
class WeightsDigest:
    """A model directory's content digest and what computing it cost."""

    digest: str
    files: int
    bytes: int  # total size of the files named
    hashed_bytes: int  # bytes read and hashed this time (0 when everything was known)
    hub_files: int  # files named by their Hugging Face blob hash
    memo_hits: int  # files whose digest came from the memo

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.digest, "files": self.files, "bytes": self.bytes,
                "hashed_bytes": self.hashed_bytes, "hub_files": self.hub_files,
                "memo_hits": self.memo_hits}


def default_memo_dir(env: dict[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/spoolctl/weights`` (default ``~/.cache/spoolctl/weights``)."""
    env = dict(os.environ) if env is None else env
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "spoolctl" / "weights"


def memo_dir_for(setting: str | None) -> Path | None:
    """The memo directory a ``spoolctl_weights_memo`` setting names (None: the default;
    ``off``: no memo)."""
    if setting == "off":
        return None
    return Path(setting) if setting else default_memo_dir()


def _model_files(model_dir: Path) -> list[tuple[str, Path]]:
    """Every non-hidden file under ``model_dir`` as (relative posix path, path), sorted.
    Directory symlinks are not followed; file symlinks are (the hub cache is made of them)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(model_dir, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if name.startswith("."):
                continue
            path = Path(dirpath) / name
            found.append((path.relative_to(model_dir).as_posix(), path))
    return sorted(found)


def _hub_blob_name(path: Path) -> str | None:
    """The content hash a Hugging Face cache snapshot file links to, or None."""
    if not path.is_symlink():
        return None
    target = Path(os.path.realpath(path))
    blobs = target.parent
    if blobs.name != "blobs" or not blobs.parent.name.startswith(("models--", "datasets--")):
        return None
    return target.name if _HUB_BLOB.fullmatch(target.name) else None


def _ident(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _hash_file(path: Path) -> tuple[str, os.stat_result]:
    """BLAKE3 of one regular file, and its identity before the read. A file that changes
    while it is read is read again once; twice is an error (someone is still writing it)."""
    for _ in range(2):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode):
                raise ConfigError("a model file is not a regular file", path=path,
                                  fix="remove it from the model directory")
            h = Hasher(threaded=True)  # engine start: the cores are otherwise idle
            buf = bytearray(_BLOCK)
            view = memoryview(buf)
            with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    h.update(view[:n])
            after = os.fstat(fd)
        finally:
            os.close(fd)
        if _ident(before) == _ident(after) and _ident(os.stat(path)) == _ident(before):
            return h.hexdigest(), before
    raise ConfigError("a model file kept changing while its digest was computed", path=path,
                      fix="start the engine once the new weights are completely written")


def _private_dir(path: Path) -> bool:
    """Whether ``path`` is a real directory of this user that nobody else can write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _usable_memo_dir(memo_dir: Path) -> bool:
    try:
        memo_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("spoolctl: weights digest memo unavailable (%s): every start hashes the "
                    "model files in full", os.strerror(exc.errno or 0))
        return False
    if not _private_dir(memo_dir):
        log.warning("spoolctl: weights digest memo %s is not a directory of this user closed "
                    "to others; ignored (every start hashes the model files in full)",
                    memo_dir)
        return False
    return True


def _read_memo(path: Path) -> dict[str, list]:
    """The memo's file records (real path -> identity + digest); {} when absent or not
    trustworthy (not this user's, writable by others, malformed)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return {}
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or st.st_size > 64 << 20):
            return {}
        try:
            doc = json.loads(f.read())
        except ValueError:
            return {}
    if not isinstance(doc, dict) or doc.get("version") != MEMO_VERSION:
        return {}
    files = doc.get("files")
    if not isinstance(files, dict):
        return {}
    return {k: v for k, v in files.items() if isinstance(v, list) and len(v) == 6
            and all(isinstance(x, int) for x in v[:5]) and isinstance(v[5], str)}


def _write_memo(path: Path, files: dict[str, list]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = json.dumps({"version": MEMO_VERSION, "files": files}, sort_keys=True).encode()
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                     0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # a memo that cannot be written only costs the next start time
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        log.warning("spoolctl: cannot write the weights digest memo (%s)",
                    os.strerror(exc.errno or 0))


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` (created 0600): ranks of one host hash a model once."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def weights_digest(model_dir: str | os.PathLike[str], *,
                   memo_dir: Path | None = None) -> WeightsDigest:
    """The content digest of ``model_dir`` (see the module docstring). ``memo_dir`` None:
    no memo, every regular file is hashed. ConfigError for a directory without files."""
    model_dir = Path(os.path.realpath(model_dir))
    if not model_dir.is_dir():
        raise ConfigError("the model is not a local directory", path=model_dir,
                          fix='set "spoolctl_weights_id" to a name that changes whenever '
                              "the weights do")
    memo_path = None
    if memo_dir is not None and _usable_memo_dir(memo_dir):
        memo_path = memo_dir / f"{hash_bytes(str(model_dir).encode())[:32]}.json"
    with _locked(memo_path.with_suffix(".lock")) if memo_path else contextlib.nullcontext():
        return _digest(model_dir, memo_path)


def _digest(model_dir: Path, memo_path: Path | None) -> WeightsDigest:
    files = _model_files(model_dir)
    memo = _read_memo(memo_path) if memo_path else {}
    fresh: dict[str, list] = {}
    parts: list[bytes] = []
    total = hashed = hub = hits = 0
    for rel, path in files:
        try:
            st = os.stat(path)
        except OSError:  # a dangling symlink or a file gone meanwhile: vLLM cannot load it
            log.warning("spoolctl: %s is not part of the weights digest (cannot be stat'ed)",
                        rel)
            continue
        if not stat.S_ISREG(st.st_mode):
            continue  # FIFOs, sockets, devices: never opened, never weights
        blob = _hub_blob_name(path)
        if blob is not None:
            digest, hub = f"hub:{blob}", hub + 1
        else:
            real = os.path.realpath(path)
            known = memo.get(real)
            if known is not None and known[:5] == _ident(st):
                digest, hits = known[5], hits + 1
            else:
                try:
                    digest, st = _hash_file(Path(real))
                except PermissionError:  # this user (vLLM's) cannot load it either
                    log.warning("spoolctl: %s is not part of the weights digest (not "
                                "readable by this user)", rel)
                    continue
                hashed += st.st_size
            fresh[real] = [*_ident(st), digest]
        total += st.st_size
        parts += [rel.encode(), str(st.st_size).encode(), digest.encode()]
    if not parts:
        raise ConfigError("the model directory holds no files", path=model_dir,
                          fix="point vLLM at a model directory")
    if memo_path is not None and fresh != {k: memo.get(k) for k in fresh}:
        _write_memo(memo_path, fresh)
    return WeightsDigest(digest=hash_parts(*parts), files=len(parts) // 3, bytes=total,
                         hashed_bytes=hashed, hub_files=hub, memo_hits=hits)


def resolve_model_dir(model: str, revision: str | None) -> Path | None:
    """The local directory vLLM loaded ``model`` from: the path itself, or the Hugging Face
    cache snapshot of a hub id (never downloads). None when neither exists."""
    if os.path.isdir(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=model, revision=revision,
                                      local_files_only=True))
    except Exception:  # not a hub id, not in the cache, or no huggingface_hub here
        return None


class AdapterDigests:
    """The content digest of a LoRA adapter per request, for the chunk chain.

    Called on the scheduler's hot path: each call walks and stats the adapter's few files
    and reuses the digest while their identities are unchanged; changed files are hashed
    again (through the memo). None when the adapter's files cannot be found or read: the
    request then bypasses the cache (never keyed by its name alone).
    """

    def __init__(self, memo_dir: Path | None):
        self._memo_dir = memo_dir
        self._known: dict[str, tuple[tuple, str]] = {}

    def __call__(self, lora_request: object) -> str | None:
        path = getattr(lora_request, "lora_path", None) or getattr(lora_request, "path", None)
        if not isinstance(path, str) or not path:
            return None
        where = resolve_model_dir(os.path.expanduser(path), None)
        if where is None:
            return None
        real = os.path.realpath(where)
        try:
            idents = tuple((rel, *_ident(os.stat(p))) for rel, p in _model_files(Path(real)))
            known = self._known.get(real)
            if known is not None and known[0] == idents:
                return known[1]
            digest = weights_digest(real, memo_dir=self._memo_dir).digest
        except (OSError, ConfigError) as exc:
            log.warning("spoolctl: LoRA adapter files unreadable, its requests bypass the "
                        "cache: %s", getattr(exc, "message", None) or exc)
            return None
        self._known[real] = (idents, digest)
        return digest
