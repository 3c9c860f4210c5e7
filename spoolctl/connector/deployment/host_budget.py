"""One disk budget per host for all rank stores of a deployment (``spoolctl_host_max_size``).

``spoolctl_max_size`` bounds each rank store; ``spoolctl_host_max_size`` bounds their sum on
one host, with no process or lock shared between the ranks' processes:

* **Shares.** Each rank's store gets a share of the host budget, in proportion to its chunk
  size (TP ranks are equal; PP stages differ by their layers): ``shares``. The scheduler
  knows from the workers' handshakes which ranks share a host (``hostname/boot id``) and
  sends each rank its share in the step metadata; until then a rank uses the smallest share
  it could have (``initial_share``: every rank of the deployment on its host), so the sum
  never exceeds the budget. A rank whose host is unknown counts on every host (fail safe).
  The share is recorded as the rank store's max size (its marker), so ``spoolctl status``
  and ``spoolctl clean`` see and enforce the same bound as the connector.
* **Eviction on every rank.** Each rank evicts its least recently used chunks when over its
  share, by withdraw-then-delete (``holdings``); a chunk one rank withdrew is dropped by
  every other rank too (``inventory.InventoryView.take_drops``), so the ranks keep holding
  the same chunks (the quorum) and the shares free the same prefixes everywhere.
* **Visible.** Workers record the budget in ``<deployment dir>/host-budget.json``;
  ``spoolctl status --root <deployment dir>`` shows the host total against it.

``spoolctl_max_size`` still applies per rank when both are set (the smaller bound wins).
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from spoolctl.store import fsync_dir, write_tmp

log = logging.getLogger("spoolctl.connector")

FILENAME = "host-budget.json"
SCHEMA = "spoolctl-host-budget/v1"


@dataclass(frozen=True)
class RankSite:
    """Where a rank runs (``hostname/boot id``) and how much one chunk costs it."""

    host: str
    chunk_bytes: int


def initial_share(budget: int, world: int) -> int:
    """A rank's share before the scheduler says which ranks share its host: as if every
    rank of the deployment did (the smallest share it can get)."""
    if budget <= 0 or world <= 0:
        raise ValueError("budget and world must be positive")
    return max(1, budget // world)


def shares(budget: int, sites: Mapping[int, RankSite], ranks: Iterable[int]) -> dict[int, int]:
    """Each known rank's share of its host's ``budget``, proportional to its chunk size.

    ``ranks``: every rank of the deployment. A rank missing from ``sites`` (no handshake)
    is assumed to share every host, at the largest chunk size seen, so shares never add
    up to more than the budget on any host.
    """
    if budget <= 0:
        raise ValueError("budget must be positive")
    unknown = [r for r in ranks if r not in sites]
    heaviest = max((s.chunk_bytes for s in sites.values()), default=1) or 1
    out: dict[int, int] = {}
    for rank, site in sites.items():
        weight = max(site.chunk_bytes, 1)
        total = sum(max(s.chunk_bytes, 1) for s in sites.values() if s.host == site.host)
        total += heaviest * len(unknown)
        out[rank] = max(1, budget * weight // total)
    return out


def effective_max(per_rank: int | None, share: int | None) -> int | None:
    """The bound a rank store enforces: the smaller of its own max and its host share."""
    bounds = [b for b in (per_rank, share) if b is not None]
    return min(bounds) if bounds else None


# -- the record ``spoolctl status`` reads ----------------------------------------------------


def _real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def record(deployment_dir: Path, budget: int) -> None:
    """Record the host budget of the deployment in ``deployment_dir`` (atomically; never
    through a symlink). Best effort: it is only read by ``spoolctl status``."""
    path = deployment_dir / FILENAME
    try:
        if not _real_dir(deployment_dir):
            return
        data = json.dumps({"schema": SCHEMA, "max_bytes": int(budget)}).encode() + b"\n"
        tmp, _, _ = write_tmp(deployment_dir, [data])
        os.replace(tmp, path)
        fsync_dir(deployment_dir)
    except Exception as exc:  # status loses a line; serving is unaffected
        log.warning("spoolctl: could not record the host budget in %s: %s",
                    deployment_dir, getattr(exc, "message", exc))


def forget(deployment_dir: Path) -> bool:
    """Remove the host budget record; True if there was one (the rank stores' recorded
    max sizes are shares of it, to be undone by their workers)."""
    try:
        os.unlink(deployment_dir / FILENAME)
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("spoolctl: could not remove %s: %s", deployment_dir / FILENAME,
                    os.strerror(exc.errno or 0))
        return False
    return True


class HostBudgetError(ValueError):
    """The host budget record exists but cannot be used (message names the fix)."""


def read(deployment_dir: Path) -> int | None:
    """The host budget recorded in ``deployment_dir``, None when there is none.
    ``HostBudgetError`` when the record is unreadable or malformed (never blocks on a FIFO,
    never follows a symlink)."""
    from .description import read_record

    path = deployment_dir / FILENAME
    doc = read_record(path, SCHEMA, {"max_bytes": (int,)}, "a host budget record",
                      "it is rewritten when the deployment's workers start (or delete it)",
                      error=HostBudgetError)
    if doc is None:
        return None
    budget = doc["max_bytes"]
    if budget <= 0:
        raise HostBudgetError(f"{path} is not a host budget record; it is rewritten when the "
                              "deployment's workers start (or delete it)")
    return budget
