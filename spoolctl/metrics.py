"""The one place that defines every spoolctl metric name.

Every metric is named ``spoolctl_*`` and uses only labels from a closed
vocabulary (``LABEL_VALUES``): result, reason, kind, step, direction -- or, for ``tenant``,
an opaque 16-hex id checked against a pattern (``PATTERN_LABELS``). No prompt
data, token ids, entry ids, keys or salts ever appear in a label value; a
label value outside the vocabulary is rejected by ``check_labels`` so a bug
cannot leak one. Store gauges of a vLLM base root or deployment directory (one set per
rank store, ``spoolctl metrics --root R``) add two *target* labels, ``deployment`` (the
deployment directory's name: a digest of the deployment identity, never prompt data) and
``rank`` (four digits), each checked against a strict pattern (``TARGET_LABELS``).

Three groups:

* Store gauges (``STORE_GAUGES``), computed from one ``Store.facts()`` snapshot by
  ``store_gauges`` (the same facts ``spoolctl status`` shows) and rendered in the
  Prometheus text format by ``render_store_metrics`` (used by ``spoolctl metrics``).
* Connector metrics (``CONNECTOR_METRICS``): counters/histograms the vLLM
  connector records in-process and exports through vLLM's own ``/metrics``.
  The connector imports the name constants from here; it must not invent its own.
* Tier metrics (``TIER_METRICS``): counters of ``SpoolTier`` (vLLM's own offloading with a
  spoolctl disk tier), exported through vLLM's ``/metrics`` by its OffloadingConnector.

Framework-free: only ``prometheus_client`` (a base dependency) and the store.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from spoolctl.store import DEPLOYMENT_NAME, RANK_DIGITS

if TYPE_CHECKING:
    from spoolctl.store import Store, StoreFacts

PREFIX = "spoolctl_"

MetricType = Literal["gauge", "counter", "histogram"]

# Closed label vocabulary: label name -> the only values it may take.
LABEL_VALUES: dict[str, frozenset[str]] = {
    "kind": frozenset({"vllm", "pytorch", "mlx", "genai"}),
    "result": frozenset({"hit", "miss", "bypass", "error"}),
    "reason": frozenset({
        # lookup miss/bypass reasons
        "none", "absent", "partial", "lora", "prompt_embeds", "multimodal", "requested",
        "disabled", "corrupt",
        # an encrypted store: a cache_salt too long to name a tenant
        "tenant",
        # skipped-store reasons
        "budget", "capacity", "io_error", "busy", "too_short", "exists", "shutdown",
        "admission", "after_gap",
        # a slow or failing disk: a read past its deadline, the store taken out
        "deadline", "disk_down",
        # a lookup after a restore that missed its deadline
        "disk_slow",
        # the day's write budget is spent, or too low for this chunk
        "write_budget",
        # why a store could not be read at all (``spoolctl_store_down_reason``)
        "permission_denied", "missing",
        # quarantine reasons (spoolctl.store.QuarantineReason values)
        "manifest_io", "manifest_validation", "payload_digest", "payload_size",
        "payload_missing", "object_collision", "catalog", "scrub_state", "auth_queue",
        "auth_tag", "unknown",
    }),
    "step": frozenset({"scrub", "capacity", "auth", "orphans", "tmp", "lease"}),
}
# Labels whose values are opaque ids, checked against a strict pattern: ``tenant`` is a tenant
# of an encrypted store by its 16-hex id (keyed with the master key: it cannot be linked to a
# cache_salt without it), or ``other`` past the connector's cap (``spoolctl_tenant_metrics``).
PATTERN_LABELS: dict[str, re.Pattern[str]] = {
    "tenant": re.compile(r"[0-9a-f]{16}|other", re.ASCII),
    # a drive's base root as configured (an operator's path, never prompt data; at most 64
    # roots): the same value as ``TARGET_LABELS["drive"]``
    "drive": re.compile(r"/[^\x00-\x1f\x7f-\x9f\ud800-\udfff]{0,1023}"),
}
# Labels that name which rank store a store gauge describes (several stores, one file).
TARGET_LABELS: dict[str, re.Pattern[str]] = {
    "deployment": re.compile(DEPLOYMENT_NAME, re.ASCII),
    "rank": re.compile(RANK_DIGITS, re.ASCII),
    # the --root of one drive of several: an absolute path, printable
    # (UTF-8; ``drive_label`` shows control characters and undecodable bytes escaped)
    "drive": re.compile(r"/[^\x00-\x1f\x7f-\x9f\ud800-\udfff]{0,1023}"),
}


@dataclass(frozen=True)
class MetricSpec:
    """A metric's name (with the ``spoolctl_`` prefix), type, help text and label names."""

    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name.startswith(PREFIX):
            raise ValueError(f"metric {self.name!r} must start with {PREFIX!r}")
        unknown = [label for label in self.labels
                   if label not in LABEL_VALUES and label not in PATTERN_LABELS]
        if unknown:
            raise ValueError(f"metric {self.name!r} uses labels outside the vocabulary: {unknown}")


def check_labels(spec: MetricSpec, labels: Mapping[str, str]) -> dict[str, str]:
    """Return ``labels`` if they are exactly ``spec.labels`` with vocabulary values.

    Raises ValueError otherwise, so no free-form (possibly sensitive) text can
    ever become a label value.
    """
    if set(labels) != set(spec.labels):
        raise ValueError(f"{spec.name} takes labels {spec.labels}, got {tuple(labels)}")
    for key, value in labels.items():
        pattern = PATTERN_LABELS.get(key)
        if pattern is not None:
            if not isinstance(value, str) or not pattern.fullmatch(value):
                raise ValueError(f"label {key}={str(value)[:40]!r} is not an opaque id "
                                 f"({spec.name})")
        elif value not in LABEL_VALUES[key]:
            raise ValueError(f"label {key}={value!r} is outside the vocabulary of {spec.name}")
    return dict(labels)


def _g(name: str, help: str, *labels: str) -> MetricSpec:
    return MetricSpec(PREFIX + name, "gauge", help, labels)


def _c(name: str, help: str, *labels: str) -> MetricSpec:
    return MetricSpec(PREFIX + name, "counter", help, labels)


def _h(name: str, help: str, *labels: str) -> MetricSpec:
    return MetricSpec(PREFIX + name, "histogram", help, labels)


# -- store gauges (spoolctl metrics) -----------------------------------------------------

STORE_ENTRIES = _g("store_entries", "Committed entries in the store.")
STORE_BYTES = _g("store_bytes", "Bytes of committed entries (manifests + objects).")
STORE_MAX_BYTES = _g("store_max_bytes", "Configured maximum size of the store (0 = unbounded).")
STORE_USAGE_RATIO = _g("store_usage_ratio", "store_bytes / store_max_bytes (0 when unbounded).")
KIND_ENTRIES = _g("store_kind_entries", "Committed entries by kind.", "kind")
KIND_BYTES = _g("store_kind_bytes", "Bytes of committed entries by kind.", "kind")
RELEASED_ENTRIES = _g("store_released_entries", "Released entries waiting for cleanup.")
RELEASED_BYTES = _g("store_released_bytes", "Bytes of released entries waiting for cleanup.")
QUARANTINED_ITEMS = _g("store_quarantined_items", "Quarantine items by reason.", "reason")
QUARANTINED_BYTES = _g("store_quarantined_bytes", "Bytes held in quarantine.")
TMP_BYTES = _g("store_tmp_bytes", "Bytes of in-flight or abandoned temp files.")
TMP_FILES = _g("store_tmp_files", "In-flight or abandoned temp files.")
OWNER_PRESENT = _g("store_owner_present", "1 if a live worker holds the store's owner lease.")
SCRUB_LAST_COMPLETED = _g("scrub_last_completed_timestamp_seconds",
                          "Unix time the last complete scrub cycle finished (0 = never).")
SCRUB_LAST_CHECKED = _g("scrub_last_checked_entries",
                        "Entries authenticated by the last complete scrub cycle.")
SCRUB_LAST_QUARANTINED = _g("scrub_last_quarantined_entries",
                            "Entries quarantined by the last complete scrub cycle.")
SCRUB_PROGRESS = _g("scrub_progress_ratio",
                    "Progress of the scrub cycle in progress (fraction of entries, 0..1).")
SCRUB_UNREADABLE = _g("scrub_unreadable_entries",
                      "Entries the last or current scrub cycle could not read (permissions, "
                      "I/O errors); the scrub moved on.")
MALFORMED_ROWS = _g("store_malformed_rows",
                    "Catalog rows with a malformed value, skipped by clean and status.")
STORE_UP = _g("store_up", "1 if the store could be opened and read for these gauges, else 0.")
STORE_DOWN = _g("store_down_reason",
                "1, beside store_up 0, labelled with why the store could not be read: "
                "permission_denied, missing, disk_down, io_error or unknown.", "reason")
FS_FREE_BYTES = _g("fs_free_bytes", "Bytes free (to this user) on the store's filesystem.")
FS_FREE_INODES = _g("fs_free_inodes",
                    "Inodes free on the store's filesystem (absent where it has no fixed "
                    "inode count); commits stop near 0 while bytes may still be free.")
FS_INODES = _g("fs_inodes", "Inodes in all on the store's filesystem (absent where not fixed).")

STORE_GAUGES: tuple[MetricSpec, ...] = (
    STORE_ENTRIES, STORE_BYTES, STORE_MAX_BYTES, STORE_USAGE_RATIO, KIND_ENTRIES, KIND_BYTES,
    RELEASED_ENTRIES, RELEASED_BYTES, QUARANTINED_ITEMS, QUARANTINED_BYTES, TMP_BYTES, TMP_FILES,
    OWNER_PRESENT, SCRUB_LAST_COMPLETED, SCRUB_LAST_CHECKED, SCRUB_LAST_QUARANTINED,
    SCRUB_PROGRESS, SCRUB_UNREADABLE, MALFORMED_ROWS, STORE_UP, STORE_DOWN, FS_FREE_BYTES,
    FS_FREE_INODES,
    FS_INODES,
)

# -- connector and background maintainer metrics (exported by the vLLM worker) ----------------

LOOKUPS = _c("lookups_total", "Prefix lookups by result and reason.", "result", "reason")
HIT_TOKENS = _c("hit_tokens_total", "Prompt tokens restored from the store instead of prefilled.")
LOOKUP_TOKENS = _c("lookup_tokens_total", "Prompt tokens looked up.")
RESTORE_BYTES = _c("restore_bytes_total", "KV bytes read, verified and restored.")
RESTORE_SECONDS = _h("restore_seconds", "Time to read, verify and copy one request's KV.")
STORE_WRITE_BYTES = _c("store_write_bytes_total", "KV bytes committed to the store.")
STORE_WRITE_SECONDS = _h("store_write_seconds", "Time to commit one chunk of KV.")
STORES_SKIPPED = _c("stores_skipped_total", "Chunks not stored, by reason.", "reason")
LOAD_ERRORS = _c("load_errors_total",
                 "Restores that failed (blocks recomputed by vLLM), by reason.", "reason")
QUARANTINE_EVENTS = _c("quarantine_events_total", "Entries quarantined, by reason.", "reason")
SCRUBBED_BYTES = _c("scrubbed_bytes_total", "Bytes re-read and verified by the background scrub.")
SCRUBBED_ENTRIES = _c("scrubbed_entries_total", "Entries verified by the background scrub.")
MAINTENANCE_ERRORS = _c("maintenance_errors_total",
                        "Background maintenance steps that failed, by step.", "step")
EVICTED_ENTRIES = _c("evicted_entries_total", "Entries evicted by capacity maintenance.")
DRIVE_FAILOVER_STORES = _c("drive_failover_stores_total",
                           "Chunks written to a runner-up drive because their home drive "
                           "(drive: its base root) was down (several drives).",
                           "drive")
AUTH_REQUESTS = _c("auth_requests_processed_total",
                   "Queued request-auth requests answered by the worker.")

# Per tenant of an encrypted store: opaque ids, at most
# ``spoolctl_tenant_metrics`` of them per process, the rest ``other``.
TENANT_LOOKUPS = _c("tenant_lookups_total",
                    "Prefix lookups on an encrypted store by tenant (opaque id) and result.",
                    "tenant", "result")
TENANT_HIT_TOKENS = _c("tenant_hit_tokens_total",
                       "Prompt tokens restored instead of prefilled, by tenant (opaque id).",
                       "tenant")
TENANT_RESTORE_BYTES = _c("tenant_restore_bytes_total",
                          "KV bytes read, authenticated and restored, by tenant (opaque id).",
                          "tenant")
TENANT_STORE_BYTES = _c("tenant_store_write_bytes_total",
                        "KV bytes committed (sealed), by tenant (opaque id).", "tenant")

CONNECTOR_METRICS: tuple[MetricSpec, ...] = (
    LOOKUPS, HIT_TOKENS, LOOKUP_TOKENS, RESTORE_BYTES, RESTORE_SECONDS, STORE_WRITE_BYTES,
    STORE_WRITE_SECONDS, STORES_SKIPPED, LOAD_ERRORS, QUARANTINE_EVENTS, SCRUBBED_BYTES,
    SCRUBBED_ENTRIES, MAINTENANCE_ERRORS, EVICTED_ENTRIES, AUTH_REQUESTS,
    TENANT_LOOKUPS, TENANT_HIT_TOKENS, TENANT_RESTORE_BYTES, TENANT_STORE_BYTES,
    DRIVE_FAILOVER_STORES,
)

# -- KV events, write admission (exported by the vLLM scheduler and /metrics) ----------------

EVENTS_STORED = _c("kv_events_stored_chunks_total",
                   "Chunks announced to routers as held by the spool tier (BlockStored).")
EVENTS_REMOVED = _c("kv_events_removed_chunks_total",
                    "Chunks withdrawn from routers (BlockRemoved).")
EVENTS_UNRESOLVED = _c("kv_events_unresolved_chunks_total",
                       "Chunks on every rank that could not be announced: no vLLM block "
                       "hashes recorded, or recorded under another hash seed.")
DISK_DOWN = _g("disk_down",
               "Rank stores the connector has taken out of service (reads late or failing: "
               "their lookups are misses and a probe checks them; 0 when all serve).")
DRIVE_DOWN = _g("drive_down",
                "Rank stores out of service on one drive (drive: its base root; several "
                "drives): taken out by their guard, not open yet, or not in "
                "the engine's drive set; summed over the workers, 0 when all serve.",
                "drive")
WRITE_AMPLIFICATION = _g("write_amplification_ratio",
                         "KV bytes written / KV bytes restored since the metrics process "
                         "started (absent until the first restore; 0 if nothing was written).")

WRITE_BUDGET = _g("write_budget_bytes",
                  "KV bytes the rank stores may write per UTC day (spoolctl_write_budget; "
                  "absent without one).")
WRITE_BUDGET_USED = _g("write_budget_used_bytes",
                       "KV bytes the rank stores wrote today (UTC), counted against "
                       "spoolctl_write_budget; absent without one.")

CONNECTOR_METRICS += (EVENTS_STORED, EVENTS_REMOVED, EVENTS_UNRESOLVED)

# -- SpoolTier under vLLM's OffloadingConnector (exported by vLLM's /metrics) -------------------

TIER_LOOKUPS = _c("tier_lookups_total", "SpoolTier chunk lookups, by result (hit, miss).",
                  "result")
TIER_PROMOTED = _c("tier_promoted_chunks_total",
                   "Chunks SpoolTier read, verified and copied into vLLM's CPU tier.")
TIER_READ_BYTES = _c("tier_read_bytes_total", "KV bytes SpoolTier promoted into the CPU tier.")
TIER_LOAD_ERRORS = _c("tier_load_errors_total",
                      "Chunks SpoolTier could not promote (vLLM recomputes them), by reason: "
                      "absent (gone since the lookup), corrupt (failed verification: "
                      "quarantined), io_error, deadline (a promotion past read_deadline).",
                      "reason")
TIER_STORED = _c("tier_stored_chunks_total", "Chunks SpoolTier committed to its store.")
TIER_WRITE_BYTES = _c("tier_write_bytes_total", "KV bytes SpoolTier committed to its store.")
TIER_STORES_SKIPPED = _c("tier_stores_skipped_total",
                         "Chunks SpoolTier did not store, by reason: busy (its store queue was "
                         "full: backpressure), io_error (the store refused them: a full disk, "
                         "capacity, an I/O error).", "reason")
TIER_METRICS: tuple[MetricSpec, ...] = (
    TIER_LOOKUPS, TIER_PROMOTED, TIER_READ_BYTES, TIER_LOAD_ERRORS, TIER_STORED,
    TIER_WRITE_BYTES, TIER_STORES_SKIPPED,
)

ALL_METRICS: tuple[MetricSpec, ...] = (*STORE_GAUGES, *CONNECTOR_METRICS, WRITE_AMPLIFICATION,
                                       DISK_DOWN, DRIVE_DOWN, WRITE_BUDGET, WRITE_BUDGET_USED,
                                       *TIER_METRICS)


@dataclass(frozen=True)
class Sample:
    """One gauge value with its labels."""

    spec: MetricSpec
    value: float
    labels: tuple[tuple[str, str], ...] = ()
    target: tuple[tuple[str, str], ...] = ()  # deployment/rank of a multi-store scrape


def check_target(target: Mapping[str, str]) -> dict[str, str]:
    """Return ``target`` if every label is a target label with a well-formed value."""
    for key, value in target.items():
        if key in TARGET_LABELS and key != "drive" and value == "":
            continue  # several drives: a label that does not apply to this store (``with_drive``)
        pattern = TARGET_LABELS.get(key)
        if pattern is None or not isinstance(value, str) or not pattern.fullmatch(value):
            raise ValueError(f"target label {key}={str(value)[:40]!r} is not allowed")
    return dict(target)


def store_gauges(facts: StoreFacts) -> list[Sample]:
    """Every store gauge from one facts snapshot (``Store.facts()``); pure.

    The vLLM connector's store gauges (bytes, max bytes, quarantined bytes) are the same
    samples, picked by spec."""
    from spoolctl.store import QuarantineReason

    max_bytes = facts.max_bytes or 0
    out = [
        Sample(STORE_ENTRIES, facts.totals.entries),
        Sample(STORE_BYTES, facts.totals.bytes),
        Sample(STORE_MAX_BYTES, max_bytes),
        Sample(STORE_USAGE_RATIO, facts.usage_ratio or 0.0),
        Sample(RELEASED_ENTRIES, facts.released_entries),
        Sample(RELEASED_BYTES, facts.released_bytes),
        Sample(QUARANTINED_BYTES, facts.quarantine.bytes),
        Sample(TMP_FILES, facts.tmp_files),
        Sample(TMP_BYTES, facts.tmp_bytes),
        Sample(OWNER_PRESENT, 1 if facts.owner is not None else 0),
        Sample(SCRUB_UNREADABLE, facts.scrub_unreadable),
        Sample(MALFORMED_ROWS, facts.malformed_rows),
        Sample(STORE_UP, 1),
    ]
    for kind in sorted(LABEL_VALUES["kind"]):
        slot = facts.by_kind.get(kind, {"entries": 0, "bytes": 0})
        out.append(Sample(KIND_ENTRIES, slot["entries"], (("kind", kind),)))
        out.append(Sample(KIND_BYTES, slot["bytes"], (("kind", kind),)))
    counts = {r.value: 0 for r in QuarantineReason}
    for reason, n in facts.quarantine.by_reason.items():
        counts[reason if reason in counts else "unknown"] += n
    for reason, n in sorted(counts.items()):
        out.append(Sample(QUARANTINED_ITEMS, n, (("reason", reason),)))
    last, current = facts.scrub.last_cycle, facts.scrub.current_cycle
    out.append(Sample(SCRUB_LAST_COMPLETED, last.finished if last and last.finished else 0))
    out.append(Sample(SCRUB_LAST_CHECKED, last.checked if last else 0))
    out.append(Sample(SCRUB_LAST_QUARANTINED, last.quarantined if last else 0))
    out.append(Sample(SCRUB_PROGRESS,
                      current.progress(facts.totals.entries) if current else 0.0))
    space = facts.space
    if space is not None:
        out.append(Sample(FS_FREE_BYTES, space.free_bytes))
        if space.inodes is not None and space.free_inodes is not None:
            out.append(Sample(FS_FREE_INODES, space.free_inodes))
            out.append(Sample(FS_INODES, space.inodes))
    for sample in out:
        check_labels(sample.spec, dict(sample.labels))
    return out


def samples_json(samples: list[Sample]) -> list[list[Any]]:
    """Store gauge samples as JSON (a bounded child hands them back, ``disk_deadline``):
    each ``[name, value, labels, target]``; ``samples_from_json`` inverts it."""
    return [[s.spec.name, s.value, [list(p) for p in s.labels], [list(p) for p in s.target]]
            for s in samples]


def samples_from_json(rows: list[list[Any]]) -> list[Sample]:
    """The samples of ``samples_json``; a name that is not a store gauge is a ValueError."""
    specs = {spec.name: spec for spec in STORE_GAUGES}
    out = []
    for name, value, labels, target in rows:
        if name not in specs:
            raise ValueError(f"{str(name)[:60]!r} is not a store gauge")
        out.append(Sample(specs[name], value, tuple((str(k), str(v)) for k, v in labels),
                          tuple((str(k), str(v)) for k, v in target)))
    return out


def collect_store_gauges(store: Store) -> list[Sample]:
    """Read the store's current gauges (one ``Store.facts()`` snapshot)."""
    return store_gauges(store.facts())


def render_samples(samples: list[Sample]) -> str:
    """Render gauge samples in the Prometheus text exposition format.

    Uses a fresh ``CollectorRegistry`` per call, so nothing leaks between calls
    or into the process-global default registry.
    """
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    gauges: dict[str, Gauge] = {}
    for sample in samples:
        spec = sample.spec
        if spec.type != "gauge":
            raise ValueError(f"{spec.name} is a {spec.type}; only gauges are rendered here")
        target = check_target(dict(sample.target))
        names = (*spec.labels, *target)
        gauge = gauges.get(spec.name)
        if gauge is None:
            gauge = Gauge(spec.name, spec.help, labelnames=names, registry=registry)
            gauges[spec.name] = gauge
        labels = {**dict(sample.labels), **target}
        (gauge.labels(**labels) if names else gauge).set(sample.value)
    return generate_latest(registry).decode()


def render_store_metrics(store: Store) -> str:
    """The store's gauges in Prometheus text format (for ``spoolctl metrics``)."""
    return render_samples(collect_store_gauges(store))


def with_target(samples: list[Sample], deployment: str, rank: int) -> list[Sample]:
    """``samples`` labelled with the rank store they describe (``TARGET_LABELS``)."""
    target = (("deployment", deployment), ("rank", f"{rank:04d}"))
    check_target(dict(target))
    return [Sample(s.spec, s.value, s.labels, target) for s in samples]


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def drive_label(root: str) -> str:
    """A drive root as a label value: label values are UTF-8, so any printable path is
    itself; a control character or a byte that is not UTF-8 (a surrogate escape) is shown
    as ``\\xNN``, so one odd root never keeps the others' gauges out."""
    def shown(match: re.Match[str]) -> str:
        code = ord(match.group())
        return f"\\x{code - 0xdc00 if 0xdc80 <= code <= 0xdcff else code:02x}" \
            if code < 0x100 or 0xdc80 <= code <= 0xdcff else f"\\u{code:04x}"
    return _UNPRINTABLE.sub(shown, root)


def with_drive(samples: list[Sample], drive: str) -> list[Sample]:
    """``samples`` of one drive of several labelled with its root, and with ``deployment``
    and ``rank`` empty where they do not apply (a drive that is one store, or down), so
    every sample of a gauge has the same label names."""
    out = []
    for s in samples:
        have = dict(s.target)
        target = (("deployment", have.get("deployment", "")), ("rank", have.get("rank", "")),
                  ("drive", drive_label(drive)))
        check_target(dict(target))
        out.append(Sample(s.spec, s.value, s.labels, target))
    return out


def store_down(deployment: str, rank: int, reason: str = "unknown") -> list[Sample]:
    """The gauges of a rank store that could not be read: ``store_up`` 0 and why."""
    return with_target(store_unreadable(reason), deployment, rank)


def store_unreadable(reason: str = "unknown") -> list[Sample]:
    """The gauges of a ``--root`` that could not be read at all (gone, unmounted, not a
    store, not this user's to read): ``store_up`` 0 and why, so an alert on it fires."""
    return [Sample(STORE_UP, 0), Sample(STORE_DOWN, 1, (("reason", reason),))]


def down_reason(exc: BaseException) -> str:
    """The ``store_down_reason`` label of the error that kept a store from being read."""
    from spoolctl.errors import (
        AccessDeniedError,
        ConfigError,
        DiskNotAnsweringError,
        StoreIOError,
    )

    if isinstance(exc, (AccessDeniedError, PermissionError)):
        return "permission_denied"
    if isinstance(exc, DiskNotAnsweringError):
        return "disk_down"
    if isinstance(exc, (StoreIOError, OSError)):
        return "io_error"
    return "missing" if isinstance(exc, ConfigError) else "unknown"
