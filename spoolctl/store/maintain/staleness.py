"""Which vLLM deployments under a base root are stale, and why (pure; no I/O, no vLLM).

A deployment directory is named by its identity's digest, so a change of weights, vLLM
version or format starts a new directory and the old one is never read again. ``judge``:

* **superseded**: another deployment of the same *lineage* (everything but weights, engine
  and format) stored its first chunk after this one was last used (two in use at once,
  an A/B rollout, are both current);
* **unused**: not used for longer than ``unused_for``;
* **current**: neither.

A deployment whose identity facts cannot be read is never superseded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

_LINEAGE = ("model", "revision", "dtype", "kv_cache_dtype", "block_size", "chunk_tokens")


@dataclass(frozen=True)
class DeploymentUse:
    """What a deployment's rank stores hold: entries, bytes, when its first chunk was
    stored and when a chunk was last used (epoch seconds), and its identity facts."""

    name: str
    entries: int
    bytes: int
    first_stored: float | None
    last_used: float | None
    identity: Mapping[str, Any] | None

    @staticmethod
    def merge(name: str, parts: Iterable[DeploymentUse]) -> DeploymentUse:
        """One deployment from its ranks' uses."""
        parts = list(parts)
        firsts = [p.first_stored for p in parts if p.first_stored is not None]
        lasts = [p.last_used for p in parts if p.last_used is not None]
        ident = next((p.identity for p in parts if p.identity), None)
        return DeploymentUse(name, sum(p.entries for p in parts), sum(p.bytes for p in parts),
                             min(firsts) if firsts else None, max(lasts) if lasts else None,
                             ident)


@dataclass(frozen=True)
class Verdict:
    """``state``: current | superseded | unused; ``reason`` for people; ``successor``: the
    deployment that replaced a superseded one."""

    state: str
    reason: str
    successor: str | None = None

    @property
    def stale(self) -> bool:
        return self.state != "current"

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "reason": self.reason, "successor": self.successor}


def lineage(identity: Mapping[str, Any] | None) -> str | None:
    """The facts two generations of one deployment share (see the module docstring)."""
    if not isinstance(identity, Mapping):
        return None
    try:
        doc = {k: identity.get(k) for k in _LINEAGE}
        doc["tp"] = int(identity["tp"][1])
        doc["pp"] = int(identity["pp"][1])
        return json.dumps(doc, sort_keys=True, default=str)
    except (KeyError, TypeError, ValueError, IndexError):
        return None


def _what_changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    changed = [what for key, what in (("weights", "weights"), ("engine", "vLLM version"))
               if old.get(key) != new.get(key)]
    return " and ".join(changed) + " changed" if changed else "identity changed"


Lineage = Callable[[Mapping[str, Any] | None], str | None]
Changed = Callable[[Mapping[str, Any], Mapping[str, Any]], str]


def judge(uses: Iterable[DeploymentUse], *, now: float, unused_for: float | None = None,
          lineage_of: Lineage = lineage, what_changed: Changed = _what_changed
          ) -> dict[str, Verdict]:
    """A verdict per deployment (see the module docstring). ``lineage_of`` and
    ``what_changed`` default to vLLM deployments' facts; other namespaces pass their own."""
    uses = list(uses)
    out: dict[str, Verdict] = {}
    for use in uses:
        line = lineage_of(use.identity)
        successors = [] if line is None or use.last_used is None else [
            other for other in uses
            if other.name != use.name and lineage_of(other.identity) == line
            and other.first_stored is not None and other.first_stored > use.last_used]
        if successors:
            newest = max(successors, key=lambda o: o.first_stored or 0.0)
            assert use.identity is not None and newest.identity is not None
            out[use.name] = Verdict("superseded", what_changed(use.identity, newest.identity),
                                    newest.name)
        elif (unused_for is not None and use.last_used is not None
              and now - use.last_used > unused_for):
            out[use.name] = Verdict("unused", f"not used for {int(now - use.last_used)} s")
        else:
            out[use.name] = Verdict("current", "in use" if use.entries else "empty")
    return out
