"""What a local model *is* at the moment of a call, for the namespace of its entries.

A backend identity (``KVBackend.identity``) names the model files the controller loaded. An
app can change the loaded model afterwards -- load PEFT / mlx-lm LoRA adapters into it,
switch or merge them, edit a weight -- and a cache of the old model would then give other
tokens than a cold run. A backend that can see such changes offers ``model_state()``: the
identity fields that say what acts on the base weights right now (``{}``: the base model
as loaded, the namespace the controller always used), or ``UnidentifiedModel`` for a change
it cannot name, which the controller answers by running without the cache (never reusing,
never writing). Pure: no framework imports.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

from spoolctl.errors import ConfigError
from spoolctl.store import hash_parts

#: The identity field that binds the adapters acting on the base weights.
ADAPTERS = "adapters"


class UnidentifiedModel(ConfigError):
    """The loaded model changed in a way its backend cannot identify (a weight edited in
    memory, an unknown wrapper): no cache entry can be said to be this model's."""

    def __init__(self, why: str):
        super().__init__(f"the model changed in a way the controller cannot identify ({why})",
                         fix="load adapters with peft / transformers' load_adapter or "
                             "mlx-lm's adapter loading; for other changes, save the model "
                             "and open a controller on the saved directory")
        self.why = why


def canonical(value: Any) -> Any:
    """``value`` as JSON the same in every process: sets sorted, enums by value, mappings by
    key, anything else as ``str``."""
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (set, frozenset)):
        return sorted((canonical(v) for v in value), key=lambda v: json.dumps(v, default=str))
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    inner = getattr(value, "value", None)  # an Enum
    return canonical(inner) if isinstance(inner, (str, int)) else str(value)


def digest_of(doc: Any) -> str:
    """``blake3:`` digest of a canonical JSON document."""
    text = json.dumps(canonical(doc), sort_keys=True, separators=(",", ":"))
    return "blake3:" + hash_parts(b"spoolctl-model-state/v1", text.encode())


class StatedIdentities:
    """Identities callers stated for the models they handed over, each with the architecture
    digest first seen under it in this process (one registry per backend; thread-safe).
    ``differs``: what another architecture means for the backend; ``fix``: what to do."""

    def __init__(self, differs: str, fix: str) -> None:
        self._differs, self._fix = differs, fix
        self._first: dict[str, str] = {}
        self._lock = threading.Lock()

    def check(self, identity: str, arch: str) -> None:
        """Refuse a stated identity this process already saw on a model of another
        architecture: the caller's promise (one identity, one set of weights) is broken."""
        with self._lock:
            first = self._first.setdefault(identity, arch)
        if first != arch:
            raise ConfigError(f"identity {identity!r} was stated for a model of another "
                              f"architecture ({self._differs})", fix=self._fix)


class StateNamespaces:
    """The (identity, namespace) of each model state seen, computed once per state."""

    def __init__(self, base: Mapping[str, str], namespace_of: Callable[[dict[str, str]], str]):
        self._base = dict(base)
        self._namespace_of = namespace_of
        self._known: dict[tuple[tuple[str, str], ...], tuple[dict[str, str], str]] = {}
        self._lock = threading.Lock()

    def of(self, extra: Mapping[str, str]) -> tuple[dict[str, str], str]:
        key = tuple(sorted(extra.items()))
        with self._lock:
            known = self._known.get(key)
            if known is None:
                identity = {**self._base, **extra}
                known = self._known[key] = (identity, self._namespace_of(identity))
            return known
