"""The two stored chunk formats: strategy objects behind one interface (``KVFormat``).

The format is chosen once at startup from the runtime KV cache groups
(``introspect.probe`` -> ``groups.choose_layouts``; ``format_choice.format_for``):

* ``SingleFormat`` (``format_single``): one full-attention group. One object ``kv`` per
  chunk; restores are asynchronous for vLLM (``load_kv_async``): read and verified on
  helper threads while other requests run, copied at the engine's safe points (``poll``),
  reported per request (``get_transfer_results``); a failure is reported per block
  (``get_block_ids_with_load_errors``: vLLM recomputes from the first bad block).
* ``GroupedFormat`` (``format_grouped``): full-attention and sliding-window groups
  (``SupportsHMA``). One object per group (``g0``, ``g1``...; a sliding group only its
  in-window tail); restores are asynchronous for vLLM (``load_kv_async``) and reported per
  request (``get_transfer_results``: a failed request is recomputed in full).

Each format has one half per vLLM role, built by the format object:

* ``Planning`` (scheduler, ``planning()``): records lookups, plans restores into the blocks
  vLLM allocated for a hit and captures of chunks once computed (``plan``), and fills each
  step's ``SpoolConnectorMetadata``.
* ``Copier`` (worker, ``copier()``): binds vLLM's KV tensors (``bind``: their layout
  proven against vLLM's declarations, copies run by one ``kvio.CopyEngine``), restores the
  step's planned chunks through the restore pipeline (``Restorer``), yields the chunks to
  capture for the ``ChunkStager``, and holds the restore outcomes vLLM collects. Copies are
  asynchronous on a device: a capture's ``fill`` returns the ``CopyHandle`` the commit
  thread waits for, a restore's ``copy`` the one its buffer is recycled after.

Everything else (lookups, inventory, the store, staging, the restore pipeline) is shared.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ..planning.plan import GroupedPlanner, Planner, ScheduledStep
from ..stats import ConnectorCounters

if TYPE_CHECKING:
    import torch

    from spoolctl.store import Store

    from ..planning.messages import SpoolConnectorMetadata
    from .kvio import CopyEngine, CopyHandle
    from .layouts import LayerDecl

# One chunk to capture: (key, chunk index, fill(buf) -> ({object name: bytes}, handle)); the
# bytes are in place once ``handle.wait()`` returned (at once on CPU).
Captured = tuple["Mapping[str, memoryview]", "CopyHandle"]
Capture = tuple[str, int, "Callable[[torch.Tensor], Captured]"]


@dataclass(frozen=True)
class ChunkRestore:
    """One chunk to restore: ``valid(manifest)`` checks its entry fits this deployment,
    ``fill(store, manifest, buf) -> bytes`` reads its verified objects into ``buf`` (helper
    thread), ``copy(buf)`` writes them into the KV blocks (engine thread, safe point)."""

    key: str
    valid: Callable[[Any], bool]
    fill: Callable[[Store, Any, torch.Tensor], int]
    # Issues the copies (compute stream ordered after them); the buffer is reused once the
    # returned handle is done (None: the copy already finished).
    copy: Callable[[torch.Tensor], CopyHandle | None]


class Restorer(Protocol):
    """What a format's ``Copier`` asks of the restore pipeline (``restore.RestorePipeline``)."""

    def begin(self, req_id: str, items: Sequence[ChunkRestore]) -> None: ...

    def cancel(self, req_ids: Iterable[str]) -> None: ...

    def pump(self, wait_s: float | None = 0.0) -> list[tuple[str, int | None]]: ...

    def take_reason(self, req_id: str) -> str | None: ...

    def run(self, items: Sequence[ChunkRestore], *, req_id: str | None = None
            ) -> int | None: ...


class Planning(ABC):
    """Scheduler half of a format: per-request planning state (not thread-safe)."""

    def __init__(self, planner: Planner | GroupedPlanner):
        self.planner = planner

    def lookup(self, req_id: str, keys: Sequence[str], present: Sequence[bool],
               num_prompt_tokens: int, num_computed: int, *, restore: bool = True) -> int:
        """Record a lookup; the tokens to restore beyond ``num_computed`` (see ``plan``)."""
        return self.planner.lookup(req_id, keys, present, num_prompt_tokens, num_computed,
                                   restore=restore)

    @abstractmethod
    def allocated(self, req_id: str, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated ``blocks`` (its ``KVCacheBlocks``) for ``num_external_tokens``."""

    @abstractmethod
    def plan_step(self, steps: Iterable[ScheduledStep], meta: SpoolConnectorMetadata) -> None:
        """Add this step's restores and captures to ``meta``."""

    def load_failures(self, finished: set[str], failed: set[str],
                      invalid_blocks: set[int]) -> set[str]:
        """The requests whose restore failed, from the workers' step output (restores that
        ``finished``, requests ``failed``, blocks reported invalid). They are not restored
        again when vLLM looks them up anew: a deterministic failure would otherwise loop."""
        return set(failed)

    def finished(self, req_id: str) -> None:
        self.planner.finished(req_id)


class Copier(ABC):
    """Worker half of a format: copies between vLLM's KV tensors and chunk buffers.

    Unbound until ``bind``; an unbound copier fails every planned restore (reported to
    vLLM for recomputation) and captures nothing.
    """

    def __init__(self, counters: ConnectorCounters):
        self._counters = counters
        self.chunk_bytes = 0  # one chunk's bytes, every object together (set by bind)
        self.layout_digest = ""  # recorded in every manifest, checked before a restore
        self.layout_json: dict = {}
        self._failed_blocks: set[int] = set()
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        # Why each restore reported failed since the last step report failed (a
        # ``load_errors_total`` reason), for the scheduler.
        self._fail_reasons: dict[str, str] = {}

    @abstractmethod
    def bind(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int | None, *,
             declared: Mapping[str, LayerDecl] | None = None,
             engine: CopyEngine | None = None) -> None:
        """Adopt vLLM's registered KV tensors, proven against ``declared`` (vLLM's layout
        declarations, ``layouts.declarations``), copied by ``engine`` (one per worker);
        ConfigError for a layout it cannot copy."""

    @abstractmethod
    def restore(self, meta: SpoolConnectorMetadata, pipeline: Restorer | None) -> None:
        """Run this step's planned restores (``pipeline`` None: cannot restore: fail them)."""

    def poll(self, pipeline: Restorer | None, finished: set[str], *,
             idle: bool) -> None:
        """A safe point (``get_transfer_results``): copy restored chunks, record the
        restores that ended. ``finished``: requests vLLM finished (stop restoring them);
        ``idle``: no request computes this step, wait a little for restores. Formats that
        restore within ``restore`` have nothing to do here."""
        return

    @abstractmethod
    def captures(self, meta: SpoolConnectorMetadata) -> Iterator[Capture]:
        """This step's planned captures, in order."""

    def take_load_errors(self) -> set[int]:
        """Blocks whose restore failed since the last call (vLLM recomputes them)."""
        errors, self._failed_blocks = self._failed_blocks, set()
        return errors

    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous restore ended since the last call, and those of
        them that failed."""
        done, self._recv_done = self._recv_done, set()
        failed, self._recv_failed = self._recv_failed, set()
        return done, failed & done

    def take_failure_reasons(self) -> dict[str, str]:
        """Why each restore reported failed since the last call failed (request id ->
        ``load_errors_total`` reason). Taken every step with the worker's report, so it
        holds one step's failures at most."""
        reasons, self._fail_reasons = self._fail_reasons, {}
        return reasons


class KVFormat(ABC):
    """A stored chunk format (see the module docstring)."""

    name: ClassVar[str]
    # Restores are reported per request (``get_transfer_results``): vLLM's load_kv_async.
    load_async: ClassVar[bool]

    @abstractmethod
    def planning(self) -> Planning:
        """A new scheduler half."""

    @abstractmethod
    def copier(self, counters: ConnectorCounters) -> Copier:
        """A new, unbound worker half."""
