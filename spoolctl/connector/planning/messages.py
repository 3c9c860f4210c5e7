"""The connector's wire messages: what vLLM carries between the scheduler and the workers.

* ``SpoolConnectorMetadata``: scheduler -> every worker, each step: the restores and
  captures planned for the step (single format: ``loads`` / ``stores``; grouped format:
  ``request_loads`` / ``group_stores``, see ``plan``), whether the step computes nothing
  (``idle``), the inventory protocol's acknowledgements and resync requests
  (``inventory``), the chunks every rank should drop, each rank's host-budget share
  (``host_budget``) and the vLLM block hashes of the chunks to store (recorded in their
  manifests for the KV events, ``events``).
* ``SpoolHandshake``: each worker -> scheduler, once at startup: where its store is and
  everything it holds.
* ``SpoolWorkerMeta``: every worker -> scheduler, each step: inventory changes, and why
  each restore reported failed in the same step failed (``restore_failure``: the reason the
  scheduler counts when vLLM looks the request up again), and, in the step after a drive
  joined a rank's set, that rank's drives. vLLM aggregates
  the workers' messages with ``aggregate``.

vLLM pickles these between processes; they hold plain data only (no stores, no tensors).
No vLLM import: ``vllm_api.wire`` registers them as vLLM's metadata types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .events import ChunkHashes
from .inventory import Ack, InventoryReport
from .plan import ChunkStore, GroupChunkStore, RequestLoad, SingleRequestLoad


@dataclass
class SpoolConnectorMetadata:
    """One step's plan, sent from the scheduler to every worker."""

    # Single format: restores begun this step (asynchronous, one per request), captures.
    loads: list[SingleRequestLoad] = field(default_factory=list)
    stores: list[ChunkStore] = field(default_factory=list)
    # Grouped format (several KV cache groups / sliding windows): asynchronous restores,
    # one per request, and per-group captures.
    request_loads: list[RequestLoad] = field(default_factory=list)
    group_stores: list[GroupChunkStore] = field(default_factory=list)
    # No request computes tokens this step (only restores are pending): a worker may wait
    # for them rather than return at once.
    idle: bool = False
    # Inventory protocol: the last report applied per rank, and ranks asked to restate.
    acks: dict[int, Ack] = field(default_factory=dict)
    resync: dict[int, int] = field(default_factory=dict)
    # Chunks a rank withdrew: every rank drops its copy too (32-byte keys).
    drops: list[bytes] = field(default_factory=list)
    # Host budget: each rank's share in bytes (sent when it changes).
    capacity: dict[int, int] = field(default_factory=dict)
    # vLLM block hashes of this step's chunks to store (by key), under ``hash_identity``.
    chunk_hashes: dict[str, ChunkHashes] = field(default_factory=dict)
    hash_identity: str = ""


@dataclass(frozen=True)
class DriveInfo:
    """One drive of a rank on several drives: its base root as configured,
    the rank store's root under it, the drive's id and the store's id (both "" for a drive
    the worker had not opened)."""

    base: str
    root: str
    drive_id: str = ""
    store_id: str = ""


@dataclass
class SpoolHandshake:
    """A worker's startup message: where its store is and everything it holds. ``drives``:
    every drive of the rank when it has several (``root``/``store_id`` are the first open
    one's); empty for one root."""

    rank: int
    host: str
    root: str
    store_id: str
    report: InventoryReport
    chunk_bytes: int = 0  # one chunk's bytes on this rank (host budget shares)
    drives: tuple[DriveInfo, ...] = ()


# A failed restore's ``load_errors_total`` reason -> the ``lookups_total{result="miss"}``
# reason of the request's next lookup. Unlisted reasons are the store's quarantine reasons
# (a digest, a tag, a manifest that does not fit): ``corrupt``.
_FAILURE_REASONS = {"deadline": "disk_slow", "disk_slow": "disk_slow", "io_error": "io_error",
                    "disk_down": "disk_down",
                    "absent": "absent", "unknown": "unknown"}
# When ranks disagree about one request the scheduler counts the most telling reason.
_FAILURE_RANK = ("corrupt", "io_error", "disk_slow", "disk_down", "absent", "unknown")


def restore_failure(load_error_reason: str) -> str:
    """The lookup reason for a restore that failed with ``load_error_reason``: one of
    ``corrupt``, ``io_error``, ``disk_slow`` (a deadline missed), ``disk_down`` (the store
    was out of service), ``absent`` (the entry went away), ``unknown``."""
    return _FAILURE_REASONS.get(load_error_reason, "corrupt")


def _telling(a: str, b: str) -> str:
    rank = {r: i for i, r in enumerate(_FAILURE_RANK)}
    return a if rank.get(a, len(rank)) <= rank.get(b, len(rank)) else b


@dataclass
class SpoolWorkerMeta:
    """One step's inventory changes and failed restores' reasons from every worker (vLLM
    aggregates across workers)."""

    reports: list[InventoryReport] = field(default_factory=list)
    # Request id -> ``restore_failure`` reason, for the restores reported failed this step.
    load_failures: dict[str, str] = field(default_factory=dict)
    # Rank -> every drive it uses now, sent once in the step after a drive that opened late
    # joined its set; empty otherwise (the handshake's ``drives`` stand).
    drives: dict[int, tuple[DriveInfo, ...]] = field(default_factory=dict)

    def aggregate(self, other: object) -> SpoolWorkerMeta:
        """This step's message joined with ``other`` worker's (vLLM's ``aggregate``)."""
        if not isinstance(other, SpoolWorkerMeta):
            return SpoolWorkerMeta(reports=list(self.reports),
                                   load_failures=dict(self.load_failures),
                                   drives=dict(self.drives))
        failures = dict(self.load_failures)
        for req_id, reason in other.load_failures.items():
            failures[req_id] = _telling(failures.get(req_id, reason), reason)
        return SpoolWorkerMeta(reports=[*self.reports, *other.reports],
                               load_failures=failures, drives={**self.drives, **other.drives})
