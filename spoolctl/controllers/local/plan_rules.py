"""Pure rules the local engine follows about plans (no store, no framework).

* ``snapshot_plan``: where a cold prefill also commits the state after the instructions
  alone, as an entry of its own (caches that cannot be cut back).
* ``same_params``: whether a catalog row holds the plan's own params under another entry id
  (the prompt rendered other tokens: a template that renders the date).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from spoolctl.store import SpoolError

from .entry_format import EntryFormat, Plan


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


def same_params(index: Any, plan: Plan) -> bool:
    """Whether a catalog index row describes the plan's own params (same group, same
    elements): with another entry id, the same params rendered other tokens."""
    return isinstance(index, dict) and index.get("group") == plan.group \
        and index.get("elements") == list(plan.elements)
