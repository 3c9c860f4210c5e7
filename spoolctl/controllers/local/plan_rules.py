"""Pure rules the local engine follows about plans (no store, no framework).

* ``snapshot_plan``: where a cold prefill also commits the state after the instructions
  alone, as an entry of its own (caches that cannot be cut back).
* ``checkpoint_positions`` / ``checkpoint_plan``: where a prefill of such a cache also
  commits its state mid-prompt, and the entry that state is (keyed by its ids alone).
* ``same_params``: whether a catalog row holds the plan's own params under another entry id
  (the prompt rendered other tokens: a template that renders the date).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from spoolctl.store import SpoolError, hash_parts

from .entry_format import EntryFormat, Plan
from .tokens import TokenPrefix

#: The first mid-prompt checkpoint; later ones double (256, 512, 1024, ...). Each one costs
#: a forward of its own (a pass over the weights), so the ids it saves must outweigh that.
CHECKPOINT_FIRST = 256
#: At most this many checkpoints per prompt: a bounded number of extra entries per prefill.
MAX_CHECKPOINTS = 16


def snapshot_plan(entry_format: EntryFormat, plan: Plan) -> Plan | None:
    """The plan of the instructions alone, where a cold prefill of ``plan`` should also
    store a snapshot there: only for caches that cannot be cut back (sliding windows,
    recurrent states), whose entries otherwise serve only prompts that extend them whole
    -- with it, one system prompt over many documents still hits."""
    params = plan.params
    if getattr(entry_format, "trimmable", True) or not entry_format.bases or \
            not params.instructions or not params.data or params.read_only:
        return None
    try:
        snap = entry_format.plan(dataclasses.replace(params, data=()))
    except (SpoolError, ValueError, TypeError):
        return None
    if snap is None or snap.entry_id == plan.entry_id or \
            not 0 < len(snap.prefix) < len(plan.prefix) or \
            not snap.prefix.is_prefix_of(list(plan.prefix.tokens)):
        return None  # e.g. a chat template that renders the instructions differently
    return snap


def checkpoint_ladder(count: int) -> list[int]:
    """The doubling checkpoint positions below ``count`` ids: 256, 512, 1024, ..."""
    out: list[int] = []
    p = CHECKPOINT_FIRST
    while p < count:
        out.append(p)
        p *= 2
    return out


def checkpoint_positions(entry_format: EntryFormat, prefix: TokenPrefix) -> list[int]:
    """Where a prefill of ``prefix`` commits its state mid-prompt: for caches that cannot
    be cut back (sliding windows, recurrent states), whose entries otherwise serve only
    prompts that extend them whole, at every doubling of 256 ids and at the start of the
    last segment (where an edited or regenerated last message parts from this prompt); at
    most ``MAX_CHECKPOINTS``. None for caches that can be cut back (any prefix of an entry
    serves), nor for a model that continues a state one id per forward (restoring and
    extending costs more than the cold prefill it saves)."""
    if getattr(entry_format, "trimmable", True) or not entry_format.bases or \
            getattr(entry_format, "extends_by_token", False) or MAX_CHECKPOINTS <= 0:
        return []
    n = len(prefix)
    last = [o for o in prefix.offsets if 0 < o < n][-1:]
    return sorted({*checkpoint_ladder(n), *last})[-MAX_CHECKPOINTS:]


def checkpoint_plan(plan: Plan, count: int, entry_id: Callable[[str, str], str]) -> Plan:
    """The entry of the state after the plan's first ``count`` ids: its key is the group
    and those ids' digest, so every prompt that shares them names the same entry
    (``entry_id(namespace, key)``: the store's id of that key)."""
    tokens = plan.prefix.tokens
    bounds = [0, *(o for o in plan.prefix.offsets if o < count), count]
    prefix = TokenPrefix.from_segments([tokens[a:b] for a, b in itertools.pairwise(bounds)])
    key = hash_parts(b"spoolctl-checkpoint/v1", plan.group.encode(), prefix.hashes[-1].encode())
    return dataclasses.replace(plan, key=key, entry_id=entry_id(plan.namespace, key),
                               prefix=prefix, elements=(),
                               lead_segments=min(plan.lead_segments, len(bounds) - 2))


def same_params(index: Any, plan: Plan) -> bool:
    """Whether a catalog index row describes the plan's own params (same group, same
    elements): with another entry id, the same params rendered other tokens. A mid-prompt
    checkpoint holds no params of its own."""
    return isinstance(index, dict) and index.get("group") == plan.group \
        and index.get("elements") == list(plan.elements) and not index.get("checkpoint")
