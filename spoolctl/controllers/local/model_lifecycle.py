"""Which controller models in a store are stale, and why (pure; no I/O, no framework).

A local controller (PyTorch, mlx-lm, mlx-vlm) keeps its entries in the namespace of its
backend identity (``tokens.namespace_for``): the model, the content digest of its files
(``revision`` / ``model_digest``), the framework versions, dtype, device and KV layout. New
weights at the same path, or a framework upgrade, give the next process a new namespace and
the old one is never read again. ``judge`` names such namespaces with the rule of the vLLM
deployments (``connector.staleness``):

* **superseded**: another namespace of the same *lineage* -- same store kind, framework,
  model, dtype, device and adapters acting (``model_state``): everything but the weights
  digest, the versions and the layout -- stored its first entry after this one was last
  used. Two namespaces of one lineage both still in use (two processes on two versions) are
  both current.
* **unused**: not used for longer than the operator's threshold.
* **current**: neither. A namespace whose identity cannot be read is never superseded.

The identity is the ``identity`` record of a manifest's meta (every local entry format
writes it); ``kind`` is added from the catalog row.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from spoolctl.store import DeploymentUse, Verdict, judge

#: Store kinds whose entries are controller models judged here (genai entries are remote
#: resources with their own expiry, vllm ones are deployments).
KINDS = ("pytorch", "mlx")

# "adapters": a model with LoRA adapters acting is a sibling of its base, never its successor
_LINEAGE = ("kind", "framework", "model", "dtype", "device", "adapters")
_WEIGHTS = ("model_digest", "revision")
_VERSIONS = ("transformers", "torch", "mlx_lm_version", "mlx_version", "mlx_vlm_version",
             "cache_format", "snapshot_format")
_LAYOUT = ("kv_layout", "model_type")


def weights(identity: Mapping[str, Any] | None) -> str | None:
    """The weights digest an identity binds (``blake3:...``, a bare digest, or a vouched
    ``trusted:<id>``), None if it binds none."""
    if not isinstance(identity, Mapping):
        return None
    for key in _WEIGHTS:
        value = identity.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def lineage(identity: Mapping[str, Any] | None) -> str | None:
    """The facts two generations of one controller model share (module docstring)."""
    if not isinstance(identity, Mapping) or not identity.get("model") \
            or not identity.get("framework") or weights(identity) is None:
        return None
    return json.dumps({k: identity.get(k) for k in _LINEAGE}, sort_keys=True, default=str)


def what_changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """For people: what differs between two generations of one lineage."""
    changed = []
    if weights(old) != weights(new):
        changed.append("weights")
    if any(old.get(k) != new.get(k) for k in _VERSIONS):
        changed.append(f"{old.get('framework')} version")
    if any(old.get(k) != new.get(k) for k in _LAYOUT):
        changed.append("KV layout")
    return " and ".join(changed) + " changed" if changed else "identity changed"


def judge_models(uses: Iterable[DeploymentUse], *, now: float,
                 unused_for: float | None = None) -> dict[str, Verdict]:
    """A verdict per controller namespace (``DeploymentUse.name`` is the namespace)."""
    return judge(uses, now=now, unused_for=unused_for, lineage_of=lineage,
                 what_changed=what_changed)
