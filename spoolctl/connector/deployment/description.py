"""What a deployment directory is for, said in the directory: ``deployment.json``.

A deployment directory is named by its identity's digest (``vllm-v1-<digest>``), which tells
an operator with three deployments on a root nothing. Each worker writes the rank-independent
facts of its identity (model, revision, dtypes, TP/PP sizes, block and chunk size, engine,
weights) next to the rank stores when it starts; ``spoolctl status`` shows them even before
the first chunk is stored. It is a label for people, never an input to a decision: the
namespace and every manifest still bind the identity, so a wrong or forged
file can mislead a reader, not a restore. Written atomically, never through a symlink; read
bounded, non-blocking, without following links; every field shown is validated text.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

from spoolctl.store import SpecialFileError, fsync_dir, read_small, write_tmp

from .identity import DeploymentIdentity

log = logging.getLogger("spoolctl.connector")

FILENAME = "deployment.json"
SCHEMA = "spoolctl-deployment/v1"
_LIMIT = 16 << 10
# Field -> accepted JSON types (what status shows; anything else makes the record invalid).
_FIELDS: dict[str, tuple[type, ...]] = {
    "model": (str,), "revision": (str, type(None)), "dtype": (str,),
    "kv_cache_dtype": (str,), "tp_size": (int,), "pp_size": (int,), "block_size": (int,),
    "chunk_tokens": (int,), "engine": (str,), "weights": (str, type(None)),
}


class DescriptionError(ValueError):
    """The record exists but cannot be used (the message names the fix)."""


def describe(identity: DeploymentIdentity) -> dict[str, Any]:
    """The record's document for ``identity`` (rank-independent: every rank writes the same)."""
    return {"schema": SCHEMA, "model": identity.model, "revision": identity.revision,
            "dtype": identity.dtype, "kv_cache_dtype": identity.kv_cache_dtype,
            "tp_size": identity.tp_size, "pp_size": identity.pp_size,
            "block_size": identity.block_size, "chunk_tokens": identity.chunk_tokens,
            "engine": identity.engine, "weights": identity.weights}


def record(deployment_dir: Path, identity: DeploymentIdentity) -> None:
    """Write ``deployment.json`` in ``deployment_dir`` unless it already says the same.
    Best effort: only people read it (a failure is one warning, serving is unaffected)."""
    path = deployment_dir / FILENAME
    doc = describe(identity)
    try:
        if not stat.S_ISDIR(os.lstat(deployment_dir).st_mode):
            return
        try:
            if read(deployment_dir) == {k: v for k, v in doc.items() if k != "schema"}:
                return  # every rank of every start writes the same: skip the fsyncs
        except DescriptionError:
            pass  # rewritten below
        data = json.dumps(doc, sort_keys=True).encode() + b"\n"
        tmp, _, _ = write_tmp(deployment_dir, [data])
        os.replace(tmp, path)
        fsync_dir(deployment_dir)
    except Exception as exc:
        log.warning("spoolctl: could not describe the deployment in %s: %s", deployment_dir,
                    getattr(exc, "message", exc))


def read(deployment_dir: Path) -> dict[str, Any] | None:
    """The description in ``deployment_dir`` (without ``schema``), None when there is none;
    ``DescriptionError`` when it is unreadable or not a description."""
    return read_record(deployment_dir / FILENAME, SCHEMA, _FIELDS, "a deployment description",
                       "its workers rewrite it at their next start (or delete it)")


def read_record(path: Path, schema: str, fields: dict[str, tuple[type, ...]], what: str,
                fix: str, error: type[ValueError] = DescriptionError) -> dict[str, Any] | None:
    """A small JSON record the connector keeps beside the rank stores (``deployment.json``,
    ``usage.json``, ``host-budget.json``): read bounded, non-blocking, without following a
    link; its fields (without ``schema``) when every one has an accepted type, None when
    there is no file, ``error`` (naming ``fix``) otherwise."""
    try:
        data = read_bounded(path, _LIMIT)
    except Unreadable as exc:
        raise error(f"{path} {exc}; {fix}") from None
    if data is None:
        return None
    try:
        doc = json.loads(data) if len(data) <= _LIMIT else None
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict) or doc.get("schema") != schema or any(
            not isinstance(doc.get(k), types) or isinstance(doc.get(k), bool)
            for k, types in fields.items()):
        raise error(f"{path} is not {what}; {fix}")
    return {k: doc[k] for k in fields}


class Unreadable(ValueError):
    """A small record that exists but cannot be read; ``str()`` says why, e.g. ``is a
    symbolic link`` (callers put the path in front and their fix after)."""


def read_bounded(path: Path, limit: int) -> bytes | None:
    """The bytes of the small file ``path`` (at most ``limit + 1``, so an oversized file
    shows), None when there is none; ``Unreadable`` for a link, something not a regular
    file (never blocks on a FIFO) or a read error. The store's one small-file reader
    (``read_small``) does the reading."""
    try:
        return read_small(path, limit)
    except FileNotFoundError:
        return None
    except SpecialFileError:
        raise Unreadable("is not a regular file") from None
    except OSError as exc:
        raise Unreadable("is a symbolic link" if exc.errno == errno.ELOOP else
                         f"cannot be read ({os.strerror(exc.errno or 0)})") from None


def summary(desc: dict[str, Any]) -> str:
    """One line for people: ``model M (rev R), float32 (KV auto), TP 2 x PP 1``."""
    rev = f" (revision {desc['revision']})" if desc.get("revision") else ""
    dtype = str(desc["dtype"]).removeprefix("torch.")
    kv = str(desc["kv_cache_dtype"]).removeprefix("torch.")
    return (f"model {desc['model']}{rev}, {dtype} (KV cache {kv}), "
            f"TP {desc['tp_size']} x PP {desc['pp_size']}, {desc['chunk_tokens']}-token chunks")
