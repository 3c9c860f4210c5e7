"""``SpoolConnector``: vLLM v1 KV connector that persists prompt-prefix KV in the spool store.

Scheduler role: computes each request's chunk chain, looks it up for every rank
(each rank's store is ``<root>/<deployment digest>/rank-<NNNN>``; a chunk is a hit
only if every rank holds it) and plans restores (into the blocks vLLM allocated for
the hit) and stores (of complete chunks once computed). Ranks on the scheduler's host
are looked up in their catalogs; ranks on other hosts through the inventory they
report over vLLM's handshake and per-step worker metadata (``inventory``).
Worker role: restores synchronously before the forward (read + verify in one
pass, then copy whole blocks into every layer) and captures stored chunks after
the forward into bounded staging memory, committed by a background thread.

``SupportsHMA``: models with several KV cache groups or sliding windows use the
grouped format (``groups``): one object per group and chunk (a sliding group only
its in-window tail), copied through each group's own layers, restored
asynchronously (``load_kv_async``; every worker reports each request in
``get_transfer_results``), captured only in the step that crosses a chunk boundary.

Failure model: anything wrong with a stored chunk (corrupt, short, missing,
deleted, layout mismatch) quarantines it where applicable and reports its blocks
through ``get_block_ids_with_load_errors`` so vLLM recomputes them (run with
``kv_load_failure_policy="recompute"``); in the grouped format the request is
reported in ``failed_recving`` instead and recomputed in full. Anything wrong
while storing skips the chunk and is counted. Requests that cannot be keyed
safely (bypass flag, LoRA, prompt embeddings, multimodal items without identity)
are neither restored nor stored. A KV layout the connector cannot persist (see
``groups``) fails at startup unless the operator chose
``spoolctl_on_unsupported = "disable"``. No prompt text, token ids, salts or keys
are logged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from spoolctl import metrics as m
from spoolctl.store import Store
from spoolctl.store.digest import hash_bytes
from spoolctl.store.errors import (
    ConfigError,
    CorruptionError,
    NotFoundError,
    QuarantineReason,
    SpoolError,
)
from spoolctl.store.keys import entry_id_for

from .chain import MMSpan, chain_root, chunk_keys
from .contract import check_contract
from .groups import (
    GroupInfo,
    GroupLayout,
    check_groups,
    group_layouts,
    is_single,
    unsupported_error,
)
from .identity import DeploymentIdentity, identity_from_vllm
from .inventory import Ack, InventoryReport, InventoryView, key_bytes
from .plan import (
    ChunkLoad,
    ChunkStore,
    GroupChunkLoad,
    GroupChunkStore,
    GroupedPlanner,
    Planner,
    RequestLoad,
)
from .settings import ConnectorSettings, parse_settings
from .stats import ConnectorCounters
from .topology import RankPlace, all_ranks, quorum

if TYPE_CHECKING:
    from .holdings import RankHoldings
    from .kvio import BufferPool, PagedKV
    from .writer import StoreWriter

log = logging.getLogger("spoolctl.connector")

KIND = "vllm"
OBJECT = "kv"
FLUSH_ON_SHUTDOWN_S = 30.0
# Chunks read + verified ahead of the one being copied (at most READ_AHEAD_BYTES), and the
# threads doing it.
READ_AHEAD = 8
READ_AHEAD_BYTES = 256 << 20
READ_THREADS = 4
GAUGE_REFRESH_S = 15.0
# vLLM's name for media it did not content-hash ("renderer0-mm-7-image-0"): a per-process
# request counter that repeats after a restart, never a persistent identity.
_COUNTER_ID = re.compile(r"^renderer\d+-mm-\d+-")


@dataclass
class SpoolConnectorMetadata(KVConnectorMetadata):
    """One step's plan, sent from the scheduler to every worker."""

    loads: list[ChunkLoad] = field(default_factory=list)
    stores: list[ChunkStore] = field(default_factory=list)
    # Grouped format (several KV cache groups / sliding windows): asynchronous restores,
    # one per request, and per-group captures.
    request_loads: list[RequestLoad] = field(default_factory=list)
    group_stores: list[GroupChunkStore] = field(default_factory=list)
    # Inventory protocol: the last report applied per rank, and ranks asked to restate.
    acks: dict[int, Ack] = field(default_factory=dict)
    resync: dict[int, int] = field(default_factory=dict)


@dataclass
class SpoolHandshake(KVConnectorHandshakeMetadata):
    """A worker's startup message: where its store is and everything it holds."""

    rank: int
    host: str
    root: str
    store_id: str
    report: InventoryReport


@dataclass
class SpoolWorkerMeta(KVConnectorWorkerMetadata):
    """One step's inventory changes from every worker (vLLM aggregates across workers)."""

    reports: list[InventoryReport] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        extra = other.reports if isinstance(other, SpoolWorkerMeta) else []
        return SpoolWorkerMeta(reports=[*self.reports, *extra])


# A helper thread's read of one chunk: (buffer, None, bytes read) or (None, reason, 0).
_ReadResult = tuple["torch.Tensor | None", "str | None", int]


class _Bypass(Exception):
    """A request that must not use the cache; ``args[0]`` is a metrics reason."""


def _engine_tag() -> str:
    # A block's byte layout is the attention kernel's business and may change between
    # vLLM minor releases and platforms; binding it here keeps old KV from being misread.
    major_minor = ".".join(str(vllm.__version__).split(".")[:2])
    try:
        from vllm.platforms import current_platform

        device = str(current_platform.device_type)
    except Exception:  # platform detection is best effort; the version still binds the layout
        device = "unknown"
    return f"vllm-{major_minor}/{device}"


def host_identity() -> str:
    """This boot of this machine: two processes with the same value share local disks."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # not Linux: the host name is the best we have
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def _parallel_ranks() -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_tp_group().rank_in_group, get_pp_group().rank_in_group
    except Exception:  # not initialised (single process without a group): rank 0
        return 0, 0


def _group_infos(kv_cache_config: Any, default_block_size: int) -> list[GroupInfo]:
    """The runtime KV cache groups, classified by vLLM's own spec semantics."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    infos = []
    for i, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        spec = group.kv_cache_spec
        try:
            kind = get_kv_cache_spec_kind(spec)
            kind = str(getattr(kind, "value", kind))
        except Exception:  # an unclassifiable spec is unknown, hence unsupported
            kind = "unknown"
        window = getattr(spec, "sliding_window", None)
        extra = getattr(spec, "extra_retained_tokens", 0) or 0
        block_size = getattr(spec, "block_size", default_block_size) or default_block_size
        flag = _group_flag(group)
        inner = getattr(spec, "kv_cache_specs", None)  # a group of per-layer specs
        if isinstance(inner, dict) and inner:
            shapes = {(getattr(s, "block_size", None), getattr(s, "sliding_window", None),
                       getattr(s, "extra_retained_tokens", 0) or 0) for s in inner.values()}
            if len(shapes) == 1:
                block_size, window, extra = next(iter(shapes))
            elif flag is None:
                flag = "mixing block sizes or windows"
        infos.append(GroupInfo(
            index=i, kind=kind, layers=tuple(group.layer_names),
            block_size=int(block_size or default_block_size),
            sliding_window=window if isinstance(window, int) else None,
            attention_chunk_size=getattr(spec, "attention_chunk_size", None),
            extra_retained_tokens=int(extra) if isinstance(extra, int) else -1, flag=flag))
    return infos


def _group_flag(group: Any) -> str | None:
    """Why vLLM's own flags on a KV cache group forbid persisting it, or None."""
    if getattr(group, "is_eagle_group", False):
        return "a draft-model (EAGLE/MTP) group"
    if not getattr(group, "enable_kv_transfer", True):
        return "not transferable (enable_kv_transfer=False)"
    if getattr(group, "host_resident", False):
        return "host-resident"
    role = getattr(group, "role", None)
    if role is not None and str(getattr(role, "value", role)) != "default":
        return f"of role {getattr(role, 'value', role)!s}"
    return None


class SpoolConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. Constructed by vLLM once per role."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        check_contract(KVConnectorBase_V1, str(vllm.__version__), SupportsHMA)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tcfg = vllm_config.kv_transfer_config
        self._block_size = int(vllm_config.cache_config.block_size)
        self._settings: ConnectorSettings = parse_settings(
            tcfg.kv_connector_extra_config, block_size=self._block_size)
        self._counters = ConnectorCounters()
        self._chunk = self._settings.chunk_tokens
        self._enabled = True
        # vLLM names media by a content hash only while its processor cache or prefix
        # caching is on; otherwise by a per-process request counter ("renderer0-mm-7-
        # image-0"), which repeats after a restart and so cannot key persistent KV.
        mm_cfg = getattr(vllm_config.model_config, "multimodal_config", None)
        self._mm_unhashed = bool(
            mm_cfg is not None and getattr(mm_cfg, "mm_processor_cache_gb", 1) == 0
            and not getattr(vllm_config.cache_config, "enable_prefix_caching", False))
        if self._mm_unhashed:
            log.warning("spoolctl: mm_processor_cache_gb=0 with prefix caching off: vLLM does "
                        "not content-hash media, so multimodal requests bypass the persistent "
                        "cache (set mm_processor_cache_gb > 0 or enable prefix caching)")
        groups = _group_infos(kv_cache_config, self._block_size)
        # One full-attention group keeps the original format (one object, synchronous
        # restores); anything else is the grouped format (SupportsHMA), see ``groups``.
        self._grouped = not is_single(groups)
        self._groups = groups
        self._layouts: list[GroupLayout] = []
        unsupported = check_groups(groups, self._chunk if self._grouped else None)
        dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
        pp = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
        if unsupported is None and self._grouped and dcp > 1:
            unsupported = f"decode context parallelism ({dcp}) with {len(groups)} KV cache " \
                          "group(s)"
        if unsupported is None and self._grouped and pp > 1:
            # Each stage sees only its own layers' groups, the scheduler stage 0's: the
            # per-group format would differ between stages.
            unsupported = f"pipeline parallelism ({pp}) with {len(groups)} KV cache group(s)"
        if unsupported is None and self._grouped:
            self._layouts = group_layouts(groups, self._chunk)
        self._grouped = bool(self._layouts)
        if unsupported is not None:
            # Fail closed: a layout we cannot persist completely is never half-served.
            if self._settings.on_unsupported != "disable":
                raise unsupported_error(unsupported)
            log.warning("spoolctl: connector disabled (spoolctl_on_unsupported=disable): %s",
                        unsupported)
            self._enabled = False
        if getattr(tcfg, "kv_load_failure_policy", "fail") != "recompute":
            log.warning("spoolctl: kv_load_failure_policy is not 'recompute': a corrupt or "
                        "missing cache entry will fail its request instead of being recomputed")
        tp_rank, pp_rank = (0, 0) if role == KVConnectorRole.SCHEDULER else _parallel_ranks()
        self._identity: DeploymentIdentity = identity_from_vllm(
            vllm_config, kv_cache_config, chunk_tokens=self._chunk, engine=_engine_tag(),
            tp_rank=tp_rank, pp_rank=pp_rank,
            group_format=[g.to_json() for g in self._layouts] if self._layouts else None)
        # Chain keys are rank-independent (the plan is shared by all ranks); entry ids
        # are per rank (each rank's namespace).
        self._chain_ns = self._identity.for_rank(tp_rank=0, pp_rank=0).namespace
        self._stores: list[tuple[Store, str]] = []
        self._load_errors: set[int] = set()
        self._holdings: RankHoldings | None = None
        self._evicted_last = 0
        self._kv: PagedKV | None = None
        self._writer: StoreWriter | None = None
        self._maintainer: Any = None
        self._maint_last: dict[str, Any] = {}
        self._gauges_at = float("-inf")
        self._read_pool: ThreadPoolExecutor | None = None
        self._read_ahead = READ_AHEAD
        self._restore_bufs: BufferPool | None = None
        self._capture_bufs: BufferPool | None = None
        # Grouped format, worker: one PagedKV per group (its layers only: block ids are
        # meaningful only in the group that owns them) and its offset in a chunk buffer.
        self._gkv: list[tuple[GroupLayout, PagedKV, int]] = []
        self._chunk_bytes = 0
        self._layout_digest = ""
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        # Scheduler: requests whose asynchronous restore failed; never restored again
        # (a deterministic failure would otherwise loop), so they recompute.
        self._no_restore: set[str] = set()
        ident = self._identity
        # The deployment digest names the directory holding every rank's store.
        self._digest = self._chain_ns
        self._places = all_ranks(ident.tp_size, ident.pp_size)
        if role == KVConnectorRole.SCHEDULER:
            self._planner: Planner | GroupedPlanner = (
                GroupedPlanner(chunk_tokens=self._chunk, groups=self._layouts)
                if self._layouts else
                Planner(chunk_tokens=self._chunk, block_size=self._block_size))
            # Filled by the workers' handshakes: a rank on this host is read in its catalog,
            # any other through its reports. Until then every rank is unknown: all misses.
            self._local: dict[int, tuple[Store, str]] = {}
            self._view = InventoryView()
        else:
            self._place = RankPlace(tp_rank, pp_rank, ident.tp_size, ident.pp_size)
            self._counters.part = str(self._place.rank)
            self._stores.append((self._open_store(self._place), ident.namespace))
        log.info("spoolctl connector (%s) ready: chunk %d tokens, namespace %s",
                 role.name.lower(), self._chunk, self._identity.namespace)

    # -- setup ---------------------------------------------------------------------------------

    _opened: dict[str, Store] = {}

    def _open_store(self, place: RankPlace, *, create: bool = True) -> Store:
        root = self._settings.root_for(digest=self._digest, place=place)
        # The scheduler and a worker of one process (uni executor) share a rank root.
        store = self._opened.get(root)
        if store is None:
            store = Store.open(root, create=create, max_bytes=self._settings.max_bytes)
            self._opened[root] = store
        return store

    @property
    def store_roots(self) -> list[str]:
        """The rank store roots this connector reads directly (scheduler: the ranks on its
        host, known after the workers' handshake; worker: its own)."""
        if self.role == KVConnectorRole.SCHEDULER:
            return [str(self._local[r][0].root) for r in sorted(self._local)]
        return [str(store.root) for store, _ in self._stores]

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        # The earliest hook vLLM calls (before any model memory is allocated).
        check_contract(KVConnectorBase_V1, str(vllm.__version__), SupportsHMA)
        return None

    # -- scheduler side -----------------------------------------------------------------------

    def _bypass_reason(self, request: Any) -> str | None:
        if not self._enabled:
            return "disabled"
        params = getattr(request, "kv_transfer_params", None) or {}
        if isinstance(params, dict) and params.get("spoolctl_bypass"):
            return "requested"
        if getattr(request, "lora_request", None) is not None:
            return "lora"
        if getattr(request, "prompt_embeds", None) is not None or request.prompt_token_ids is None:
            return "prompt_embeds"
        return None

    @staticmethod
    def _mm_spans(request: Any) -> list[MMSpan]:
        """Media identity of every multimodal item; ``_Bypass`` when any part is missing.

        An item without its content hash, modality or placeholder range could make two
        different images share KV, so the whole request bypasses persistent reuse.
        """
        spans = []
        for feature in getattr(request, "mm_features", None) or ():
            ident = getattr(feature, "identifier", None)
            modality = getattr(feature, "modality", None)
            pos = getattr(feature, "mm_position", None)
            if not ident or not modality or pos is None or _COUNTER_ID.match(str(ident)):
                raise _Bypass("multimodal")
            try:
                spans.append(MMSpan(str(ident), int(pos.offset), int(pos.length),
                                    modality=str(modality)))
            except (TypeError, ValueError):
                raise _Bypass("multimodal") from None
        return spans

    def _chain(self, request: Any) -> list[str]:
        spans = self._mm_spans(request)
        if spans and self._mm_unhashed:
            raise _Bypass("multimodal")  # identifiers are request counters, not content
        root = chain_root(self._chain_ns, getattr(request, "cache_salt", None))
        return chunk_keys(root, request.prompt_token_ids, self._chunk, spans)

    def _present(self, keys: list[str]) -> list[bool]:
        """Which chunks *every* rank holds (committed, retained): the quorum.

        Ranks on this host are read in their catalogs at every lookup; the others in the
        inventory they reported. A rank withdraws an entry before deleting it (see
        ``holdings``), so no request is planned against a chunk a rank evicted.
        """
        raw = [key_bytes(k) for k in keys]

        def per_rank():
            for place in self._places:
                local = self._local.get(place.rank)
                if local is None:
                    yield self._view.has(place.rank, raw)
                    continue
                store, ns = local
                ids = [entry_id_for(KIND, ns, k) for k in keys]
                live = store.live(ids)
                yield [i in live for i in ids]

        return quorum(per_rank(), len(keys))

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Every worker's handshake, keyed by (pp_rank, tp_rank): adopt its inventory, and read
        its catalog directly when its store is on this host (and inventory mode allows)."""
        here = host_identity()
        tp_size = self._identity.tp_size
        for (pp_rank, tp_rank), hs in metadata.items():
            if not isinstance(hs, SpoolHandshake) or hs.rank != pp_rank * tp_size + tp_rank:
                log.warning("spoolctl: ignoring a malformed handshake from pp %s tp %s; that "
                            "rank's chunks are misses", pp_rank, tp_rank)
                continue
            self._view.apply(hs.report)
            if self._settings.inventory == "auto" and hs.host == here:
                self._adopt_local(hs)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): hs for tp, hs in metadata.items()})

    def _adopt_local(self, hs: SpoolHandshake) -> None:
        place = next((p for p in self._places if p.rank == hs.rank), None)
        if place is None:
            return
        expected = self._settings.root_for(digest=self._digest, place=place)
        if os.path.normpath(hs.root) != os.path.normpath(expected):
            return
        try:
            store = self._open_store(place, create=False)
        except SpoolError as exc:
            log.warning("spoolctl: rank %d store not readable here (%s); using its reports",
                        hs.rank, exc.message)
            return
        if store.marker.store_id != hs.store_id:
            return  # same path, different store (another disk mounted there): use reports
        ns = self._identity.for_rank(tp_rank=place.tp_rank, pp_rank=place.pp_rank).namespace
        self._local[hs.rank] = (store, ns)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        # Grouped format: a request whose restore failed recomputes without the cache.
        self._no_restore.update(getattr(connector_output, "failed_recving", None) or ())
        if not isinstance(meta, SpoolWorkerMeta):
            return
        before = self._view.resync_requests()
        for report in meta.reports:
            self._view.apply(report)
        for rank in self._view.resync_requests().keys() - before.keys():
            log.warning("spoolctl: lost track of rank %d's inventory (a report went missing "
                        "or the rank restarted); its chunks are misses until it restates it",
                        rank)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        req_id = request.request_id
        self._planner.finished(req_id)  # a re-query (e.g. after preemption) starts afresh
        reason = self._bypass_reason(request)
        try:
            if reason is not None:
                raise _Bypass(reason)
            keys = self._chain(request)
            present = self._present(keys)
        except _Bypass as bypass:
            self._counters.inc(m.LOOKUPS, result="bypass", reason=bypass.args[0])
            return 0, False
        except SpoolError as exc:
            log.warning("spoolctl: lookup failed, serving without cache: %s", exc.message)
            self._counters.inc(m.LOOKUPS, result="error", reason="none")
            return 0, False
        n_prompt = len(request.prompt_token_ids)
        if req_id in self._no_restore and isinstance(self._planner, GroupedPlanner):
            # Its asynchronous restore failed (a bad entry was quarantined): recompute it in
            # full rather than risk the same failure again; absent chunks are still stored.
            self._planner.lookup(req_id, keys, present, n_prompt, num_computed_tokens,
                                 restore=False)
            self._counters.inc(m.LOOKUPS, result="miss", reason="corrupt")
            return 0, False
        ext = self._planner.lookup(req_id, keys, present, n_prompt, num_computed_tokens)
        self._counters.inc(m.LOOKUP_TOKENS, n_prompt)
        if ext > 0:
            usable = (n_prompt - 1) // self._chunk
            full = sum(present[:usable]) == usable
            self._counters.inc(m.LOOKUPS, result="hit", reason="none" if full else "partial")
            self._counters.inc(m.HIT_TOKENS, ext)
            hit_chunks = -(-(num_computed_tokens + ext) // self._chunk)
            for store, ns in self._local.values():
                store.touch(entry_id_for(KIND, ns, k) for k in keys[:hit_chunks])
        else:
            self._counters.inc(m.LOOKUPS, result="miss", reason="absent")
        # Grouped format: asynchronous, so a failed restore can be reported per request
        # (failed_recving); vLLM refuses block-level errors with several groups.
        return ext, self._grouped and ext > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        if isinstance(self._planner, GroupedPlanner):
            if num_external_tokens > 0:
                self._planner.allocated(request.request_id, blocks.get_block_ids(),
                                        num_external_tokens)
            return
        self._planner.allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if isinstance(self._planner, GroupedPlanner):
            return self._build_grouped_meta(self._planner, scheduler_output)
        meta = SpoolConnectorMetadata()
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            loads, stores = self._planner.scheduled(
                new.req_id, new.block_ids[0] if new.block_ids else None, replace=True,
                computed_after=new.num_computed_tokens + sched.get(new.req_id, 0))
            meta.loads += loads
            meta.stores += stores
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            loads, stores = self._planner.scheduled(
                req_id, new_blocks[0] if new_blocks else None,
                replace=req_id in cached.resumed_req_ids,
                computed_after=cached.num_computed_tokens[i] + sched.get(req_id, 0))
            meta.loads += loads
            meta.stores += stores
        meta.acks = self._view.acks()
        meta.resync = self._view.resync_requests()
        return meta

    def _build_grouped_meta(self, planner: GroupedPlanner,
                            scheduler_output: Any) -> SpoolConnectorMetadata:
        meta = SpoolConnectorMetadata(request_loads=planner.take_loads())
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            before = new.num_computed_tokens
            meta.group_stores += planner.scheduled(
                new.req_id, new.block_ids, replace=True, computed_before=before,
                computed_after=before + sched.get(new.req_id, 0), first=True)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            resumed = req_id in cached.resumed_req_ids
            before = cached.num_computed_tokens[i]
            meta.group_stores += planner.scheduled(
                req_id, cached.new_block_ids[i], replace=resumed, computed_before=before,
                computed_after=before + sched.get(req_id, 0), first=resumed)
        meta.acks = self._view.acks()
        meta.resync = self._view.resync_requests()
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        # Stores are captured synchronously after the forward, so the blocks are free to go.
        self._planner.finished(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        # vLLM calls this instead of request_finished once the connector claims SupportsHMA
        # (for one group too). Captures are synchronous, restores end before the request
        # leaves WAITING_FOR_REMOTE_KVS (vLLM delays freeing until then): nothing to hold.
        self._planner.finished(request.request_id)
        self._no_restore.discard(request.request_id)
        return False, None

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from .holdings import RankHoldings
        from .kvio import BufferPool, PagedKV
        from .writer import StoreWriter

        if not self._enabled:
            # A layout declared unsupported at startup (spoolctl_on_unsupported=disable):
            # never copied. No handshake follows, so the scheduler counts no rank: all misses.
            return
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        try:
            if self._grouped:
                kv = None
                self._gkv = self._group_kv(kv_caches, num_blocks)
                chunk_bytes = self._chunk_bytes = sum(g[1].chunk_bytes for g in self._gkv)
                layout_json = {"groups": [{**lay.to_json(), **gkv.layout_json}
                                          for lay, gkv, _ in self._gkv]}
                self._layout_digest = hash_bytes(json.dumps(
                    layout_json, sort_keys=True, separators=(",", ":")).encode())
            else:
                kv = PagedKV(kv_caches, num_blocks=num_blocks,
                             blocks_per_chunk=self._chunk // self._block_size)
                chunk_bytes, layout_json = kv.chunk_bytes, kv.layout_json
                self._layout_digest = kv.layout_digest
        except ConfigError as exc:
            if self._settings.on_unsupported != "disable":
                raise
            # No handshake follows, so the scheduler never counts this rank: all misses.
            log.warning("spoolctl: connector disabled on this rank "
                        "(spoolctl_on_unsupported=disable): %s", exc.message)
            self._enabled = False
            return
        self._kv = kv
        self._read_pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="spoolctl-restore")
        self._read_ahead = max(2, min(READ_AHEAD, READ_AHEAD_BYTES // chunk_bytes))
        self._restore_bufs = BufferPool(chunk_bytes, slots=self._read_ahead)
        # One slot per chunk the staging budget admits: a successful reserve() always finds one.
        self._capture_bufs = BufferPool(
            chunk_bytes, slots=max(1, self._settings.staging_bytes // chunk_bytes))
        store, ns = self._stores[0]
        summary = self._identity.summary()
        holdings = self._holdings = RankHoldings(
            store, kind=KIND, namespace=ns, rank=self._place.rank,
            epoch=store.next_generation(f"vllm-connector:{ns}"))
        holdings.start()

        def put(key: str, payload: Any, meta: Any) -> None:
            # No commit-time eviction: holdings withdraws victims from the scheduler first.
            objects = payload if isinstance(payload, dict) else {OBJECT: payload}
            store.put(kind=KIND, namespace=ns, key=key, objects=objects, meta=meta, evict=False)
            holdings.committed(key)

        self._writer = StoreWriter(put, staging_bytes=self._settings.staging_bytes,
                                   counters=self._counters)
        self._meta_base = {"layout": self._layout_digest, "chunk_tokens": self._chunk,
                           "chunk_bytes": chunk_bytes, "deployment": summary,
                           "kv_layout": layout_json}
        self._start_maintainer(store)

    def _group_kv(self, kv_caches: dict[str, torch.Tensor],
                  num_blocks: int | None) -> list[tuple[GroupLayout, PagedKV, int]]:
        """Per group, its layers' tensors (grouped format), each with its offset in a chunk
        buffer. Groups overlay one memory buffer and a block id means something only in its
        own group's layers; KV-sharing alias layers (in ``kv_caches`` but in no group) are
        left out: their target layer is copied once."""
        from .kvio import PagedKV

        out, offset = [], 0
        for info, lay in zip(self._groups, self._layouts, strict=True):
            mine = {n: kv_caches[n] for n in info.layers if n in kv_caches}
            if not mine:
                raise ConfigError(
                    f"KV cache group {info.index} has no registered KV tensors",
                    path="kv_caches", fix='set "spoolctl_on_unsupported": "disable" to serve '
                                          "without the connector")
            gkv = PagedKV(mine, num_blocks=num_blocks, blocks_per_chunk=lay.stored_blocks)
            out.append((lay, gkv, offset))
            offset += gkv.chunk_bytes
        return out

    def _start_maintainer(self, store: Store) -> None:
        if self._settings.scrub_rate <= 0:
            return
        try:
            from spoolctl.store.maintainer import BackgroundMaintainer
        except ImportError:
            return
        try:
            self._maintainer = BackgroundMaintainer(
                store, scrub_rate_bytes=self._settings.scrub_rate,
                interval_s=self._settings.maintenance_interval, role="vllm-worker",
                enforce_capacity=False)  # RankHoldings evicts (withdraw, then delete)
            self._maintainer.start()
        except Exception as exc:  # maintenance is an optimisation; never block serving
            log.warning("spoolctl: background maintenance not started: %s", exc)
            self._maintainer = None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, SpoolConnectorMetadata):
            return
        for req_load in meta.request_loads:
            # Every worker reports every request (vLLM waits for all of them); a failure
            # is reported as finished and failed, and vLLM recomputes the request.
            ok = False
            try:
                ok = self._restore_grouped(req_load)
            except Exception:  # never let a cache problem take the worker down
                log.exception("spoolctl: unexpected restore error, recomputing")
            self._recv_done.add(req_load.req_id)
            if not ok:
                self._recv_failed.add(req_load.req_id)
        if meta.loads and (self._kv is None or self._read_pool is None):
            # Cannot happen when the scheduler only plans against ranks that reported; if it
            # does, the target blocks hold garbage: have vLLM recompute them.
            for load in meta.loads:
                self._load_errors.update(load.target_blocks)
            self._counters.inc(m.LOAD_ERRORS, len(meta.loads), reason="unknown")
        elif meta.loads:
            by_req: dict[str, list[ChunkLoad]] = {}
            for load in meta.loads:
                by_req.setdefault(load.req_id, []).append(load)
            for loads in by_req.values():
                self._restore_request(sorted(loads, key=lambda ld: ld.index))
        # Only now, after this step's loads: every plan built before the scheduler applied
        # a withdrawal has been served, so acknowledged entries may be deleted.
        if self._holdings is not None:
            self._holdings.on_scheduler(meta.acks, meta.resync)

    def get_handshake_metadata(self) -> SpoolHandshake | None:
        if self._holdings is None:
            return None
        store = self._stores[0][0]
        return SpoolHandshake(rank=self._place.rank, host=host_identity(), root=str(store.root),
                              store_id=store.marker.store_id,
                              report=self._holdings.handshake_report())

    def build_connector_worker_meta(self) -> SpoolWorkerMeta | None:
        if self._holdings is None:
            return None
        report = self._holdings.step_report()
        return SpoolWorkerMeta(reports=[report]) if report is not None else None

    def _restore_request(self, loads: list[ChunkLoad]) -> None:
        """Restore a request's chunks in order (single format). On the first failure this
        chunk and every later one are recomputed by vLLM (it truncates the request at the
        first failed block): report all their blocks, load nothing more."""
        assert self._kv is not None
        kv = self._kv
        failed_at = self._pipelined_restore(
            loads, self._read_chunk, lambda load, buf: kv.restore(buf, load.block_ids, load.skip))
        if failed_at is not None:
            for rest in loads[failed_at:]:
                self._load_errors.update(rest.target_blocks)

    def _restore_grouped(self, load: RequestLoad) -> bool:
        """Restore one request's chunks (grouped format); False on any failure."""
        if not load.ok or not self._gkv or self._read_pool is None:
            self._counters.inc(m.LOAD_ERRORS, reason="unknown")
            return False

        def copy(chunk: GroupChunkLoad, buf: torch.Tensor) -> None:
            for (_lay, gkv, offset), targets in zip(self._gkv, chunk.targets, strict=True):
                if targets is not None:
                    gkv.restore(buf[offset:offset + gkv.chunk_bytes], targets, skip_null=True)

        return self._pipelined_restore(load.chunks, self._read_group_chunk, copy) is None

    def _pipelined_restore(self, items: Sequence[Any], read: Callable[[Any], _ReadResult],
                           copy: Callable[[Any, torch.Tensor], None]) -> int | None:
        """Read + verify ``items`` on helper threads (both release the GIL), ``read_ahead``
        ahead of the one being copied with ``copy(item, buf)``, in order. Returns the
        position of the first item that failed (counted in LOAD_ERRORS), else None.

        ``read(item)`` returns ``(buffer, None, bytes)`` or ``(None, reason, 0)``.
        """
        started = time.perf_counter()
        restored = 0
        pending: deque[Future] = deque()
        it = iter(items)
        failed_at = None

        def refill() -> None:
            while len(pending) < self._read_ahead:
                item = next(it, None)
                if item is None:
                    return
                pending.append(self._read_pool.submit(read, item))

        try:
            refill()
            for pos, item in enumerate(items):
                buf, reason, nbytes = pending.popleft().result()
                if buf is not None:
                    try:
                        copy(item, buf)
                    except Exception:  # a copy bug must not take the worker down
                        log.exception("spoolctl: restore copy failed, recomputing")
                        reason = "unknown"
                    finally:
                        self._restore_bufs.put(buf)
                if reason is not None:
                    self._counters.inc(m.LOAD_ERRORS, reason=reason)
                    failed_at = pos
                    break
                restored += nbytes
                refill()
        finally:
            for fut in pending:  # bounded by the read-ahead; their buffers are recycled
                buf, _, _ = fut.result()
                if buf is not None:
                    self._restore_bufs.put(buf)
        if restored:
            self._counters.inc(m.RESTORE_BYTES, restored)
            self._counters.observe(m.RESTORE_SECONDS, time.perf_counter() - started)
        return failed_at

    def _read_chunk(self, load: ChunkLoad) -> _ReadResult:
        """Read and verify one chunk (single format) into a new buffer (helper thread)."""
        kv = self._kv
        assert kv is not None

        def valid(manifest: Any) -> bool:
            return manifest.meta.get("layout") == kv.layout_digest and \
                manifest.object(OBJECT).size == kv.chunk_bytes

        def fill(store: Store, manifest: Any, buf: torch.Tensor) -> int:
            store.read(manifest, OBJECT, into=memoryview(buf.numpy()))
            return kv.chunk_bytes

        return self._read_verified(load.key, valid, fill)

    def _read_group_chunk(self, chunk: GroupChunkLoad) -> _ReadResult:
        """Read and verify the objects of one chunk that a restore needs (grouped format)."""
        try:
            wanted = [(lay, gkv, off) for (lay, gkv, off), t
                      in zip(self._gkv, chunk.targets, strict=True) if t is not None]
        except ValueError:  # a plan for another group layout: never restore from it
            log.error("spoolctl: restore plan does not match the KV cache groups, recomputing")
            return None, "unknown", 0

        def valid(manifest: Any) -> bool:
            names = {ref.name: ref for ref in manifest.objects}
            return manifest.meta.get("layout") == self._layout_digest and all(
                lay.name in names and names[lay.name].size == gkv.chunk_bytes
                for lay, gkv, _ in wanted)

        def fill(store: Store, manifest: Any, buf: torch.Tensor) -> int:
            nbytes = 0
            for lay, gkv, off in wanted:
                store.read(manifest, lay.name,
                           into=memoryview(buf[off:off + gkv.chunk_bytes].numpy()))
                nbytes += gkv.chunk_bytes
            return nbytes

        return self._read_verified(chunk.key, valid, fill)

    def _read_verified(self, key: str, valid: Callable[[Any], bool],
                       fill: Callable[[Store, Any, torch.Tensor], int]) -> _ReadResult:
        """Load chunk ``key``'s manifest, check it with ``valid(manifest)`` (a mismatch is
        quarantined), then ``fill(store, manifest, buf) -> bytes`` a restore buffer with its
        verified objects. Returns ``(buffer, None, bytes)`` or ``(None, reason, 0)`` where
        reason is a metrics label; never raises (helper thread)."""
        store, ns = self._stores[0]
        entry_id = entry_id_for(KIND, ns, key)
        try:
            manifest = store.manifest(entry_id)
            if not valid(manifest):
                store.quarantine_entry(entry_id, QuarantineReason.MANIFEST_VALIDATION,
                                       "KV layout does not match this deployment")
                self._lost(key)
                self._counters.inc(m.QUARANTINE_EVENTS, reason="manifest_validation")
                return None, "manifest_validation", 0
            buf = self._restore_bufs.get()
            if buf is None:  # cannot happen: one slot per chunk in flight
                return None, "unknown", 0
            try:
                nbytes = fill(store, manifest, buf)
            except BaseException:
                self._restore_bufs.put(buf)  # its contents are garbage, but reusable
                raise
            # Each rank keeps its own LRU clock: the scheduler may not see this store.
            store.touch([entry_id])
            return buf, None, nbytes
        except CorruptionError as exc:
            self._lost(key)
            self._counters.inc(m.QUARANTINE_EVENTS, reason=exc.reason.value)
            log.warning("spoolctl: cached chunk failed verification (%s); quarantined, "
                        "recomputing", exc.reason.value)
            return None, exc.reason.value, 0
        except (NotFoundError, KeyError):
            self._lost(key)
            return None, "absent", 0
        except SpoolError as exc:
            log.warning("spoolctl: restore failed, recomputing: %s", exc.message)
            return None, "io_error", 0
        except Exception:  # never let a cache problem take the worker down
            log.exception("spoolctl: unexpected restore error, recomputing")
            return None, "unknown", 0

    def _lost(self, key: str) -> None:
        if self._holdings is not None:
            self._holdings.lost(key)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # restores complete in start_load_kv, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole chunks are captured in wait_for_save, after every layer ran

    def wait_for_save(self):
        if not self.has_connector_metadata() or self._writer is None:
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, SpoolConnectorMetadata):
            return
        if self._gkv:
            for gop in meta.group_stores:
                self._stage(gop.key, gop.index, self._chunk_bytes,
                            lambda buf, gop=gop: self._capture_grouped(gop, buf))
        if self._kv is None:
            return
        kv = self._kv
        for op in meta.stores:
            def fill(buf: torch.Tensor, op: ChunkStore = op) -> memoryview:
                kv.capture(op.block_ids, buf)
                return memoryview(buf.numpy())

            self._stage(op.key, op.index, kv.chunk_bytes, fill)

    def _stage(self, key: str, index: int, nbytes: int, fill: Any) -> None:
        """Capture one chunk into a staging buffer with ``fill(buf) -> payload`` and queue its
        commit; a chunk over the staging budget or failing to capture is skipped, counted."""
        from .writer import PendingStore

        if not self._writer.reserve(key, nbytes):
            return
        buf = self._capture_bufs.get()
        if buf is None:  # more chunks in flight than slots: same as over budget
            self._writer.cancel(key, nbytes)
            self._counters.inc(m.STORES_SKIPPED, reason="budget")
            return
        try:
            payload = fill(buf)
        except Exception:
            self._capture_bufs.put(buf)
            self._writer.cancel(key, nbytes)
            log.exception("spoolctl: could not capture a chunk; not stored")
            self._counters.inc(m.STORES_SKIPPED, reason="io_error")
            return
        meta_doc = dict(self._meta_base, chunk_index=index)
        self._writer.submit(PendingStore(
            key, payload, nbytes, meta_doc, on_done=lambda buf=buf: self._capture_bufs.put(buf)))

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, self._recv_done = self._recv_done, set()
        failed, self._recv_failed = self._recv_failed, set()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed & done)

    def _capture_grouped(self, op: GroupChunkStore, buf: torch.Tensor) -> dict[str, memoryview]:
        """Copy one chunk's stored blocks of every group (grouped format) into ``buf``;
        return one object per group."""
        objects = {}
        for (lay, gkv, offset), ids in zip(self._gkv, op.blocks, strict=True):
            if 0 in ids:  # never read the null block (the planner does not send it)
                raise ValueError("null block in a capture")
            part = buf[offset:offset + gkv.chunk_bytes]
            gkv.capture(ids, part)
            objects[lay.name] = memoryview(part.numpy())
        return objects

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    # -- stats, metrics, lifecycle ------------------------------------------------------------

    def _collect_maintainer(self) -> None:
        """Fold the background maintainer's progress since the last call into the counters."""
        if self._holdings is not None:
            evicted = self._holdings.evicted_entries
            if evicted > self._evicted_last:
                self._counters.inc(m.EVICTED_ENTRIES, evicted - self._evicted_last)
                self._evicted_last = evicted
        if self._maintainer is None:
            return
        snap = self._maintainer.counters.snapshot()
        last, self._maint_last = self._maint_last, snap
        for key, spec in (("scrubbed_bytes", m.SCRUBBED_BYTES),
                          ("scrubbed_entries", m.SCRUBBED_ENTRIES),
                          ("evicted_entries", m.EVICTED_ENTRIES),
                          ("auth_requests", m.AUTH_REQUESTS)):
            delta = snap.get(key, 0) - last.get(key, 0)
            if delta > 0:
                self._counters.inc(spec, delta)
        for field_name, spec, label in (("quarantine_events", m.QUARANTINE_EVENTS, "reason"),
                                        ("errors", m.MAINTENANCE_ERRORS, "step")):
            now, before = snap.get(field_name, {}), last.get(field_name, {})
            for value, count in now.items():
                delta = count - before.get(value, 0)
                if delta > 0 and value in m.LABEL_VALUES[label]:
                    self._counters.inc(spec, delta, **{label: value})

    def _refresh_gauges(self) -> None:
        """Disk and quarantine bytes of the worker's store, computed off the engine loop."""
        now = time.monotonic()
        if self._read_pool is None or now - self._gauges_at < GAUGE_REFRESH_S:
            return
        self._gauges_at = now
        store = self._stores[0][0]

        def refresh() -> None:
            try:
                self._counters.set_gauge(m.STORE_BYTES, store.totals().bytes)
                self._counters.set_gauge(m.STORE_MAX_BYTES, store.max_bytes or 0)
                self._counters.set_gauge(m.QUARANTINED_BYTES,
                                         sum(i.bytes for i in store.quarantine_items()))
            except Exception as exc:  # metrics are best effort
                log.debug("spoolctl: gauge refresh failed: %s", exc)

        self._read_pool.submit(refresh)

    def get_kv_connector_stats(self) -> Any:
        self._refresh_gauges()
        self._collect_maintainer()
        data = self._counters.take()
        if not data:
            return None
        from .promstats import SpoolStats

        return SpoolStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        from .promstats import SpoolStats

        return SpoolStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        from .promstats import SpoolPromMetrics

        return SpoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @property
    def counters(self) -> ConnectorCounters:
        """Cumulative counters of this connector instance (for tests and diagnostics)."""
        return self._counters

    @property
    def inventory_state(self) -> dict:
        """Worker: its inventory (epoch, held, awaiting acknowledgement, deletions after
        one); scheduler: per rank, how many chunks it is known to hold and how it is read."""
        if self.role == KVConnectorRole.SCHEDULER:
            return {p.rank: {"source": "catalog" if p.rank in self._local else "reports",
                             "known": self._view.known(p.rank)} for p in self._places}
        return self._holdings.state() if self._holdings is not None else {}

    @property
    def maintainer(self) -> Any:
        """The worker's ``BackgroundMaintainer`` (None when disabled or on the scheduler)."""
        return self._maintainer

    @property
    def namespace(self) -> str:
        return self._identity.namespace

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued stores to be committed (worker role); False on timeout."""
        return self._writer.flush(timeout) if self._writer is not None else True

    def reset_cache(self) -> bool | None:
        # The store is persistent and shared with the CLI; a reset of vLLM's prefix cache
        # must not delete it. Clearing the store is `spoolctl clean`'s job.
        return False

    def shutdown(self):
        if self._writer is not None:
            if not self._writer.close(FLUSH_ON_SHUTDOWN_S):
                log.warning("spoolctl: shutdown before all stores were committed; "
                            "the rest are skipped")
            self._writer = None
        if self._maintainer is not None:
            with contextlib.suppress(Exception):
                self._maintainer.stop()
            self._maintainer = None
        if self._holdings is not None:
            with contextlib.suppress(Exception):
                self._holdings.stop()
            self._holdings = None
        if self._read_pool is not None:
            self._read_pool.shutdown(wait=True)
            self._read_pool = None
