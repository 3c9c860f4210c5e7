"""Entry formats: the variation point of the local engine.

``LocalCacheController`` (``engine.py``) does everything that is the same for every
local entry: single-flight, key locks, the memory LRU, disk lookups, verification,
quarantine, base selection, commit, release, close, usage. What an entry *is* -- how
params become a prompt and a key, what the manifest must say, how a cache becomes
bytes and back, how a cache is continued -- is an ``EntryFormat``:

* ``KVEntryFormat`` (here): plain KV caches of a ``KVBackend`` (PyTorch, mlx-lm);
  prefix-matching, incremental prefill from bases (``bases = True``).
* ``VlmEntryFormat`` (``mlx/vlm.py``): mlx-vlm exact snapshots with image identity;
  exact-match only (``bases = False``).

Everything here is pure logic over the backend; no store I/O.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard, runtime_checkable

from spoolctl.store import ConfigError, entry_id_for, hash_parts

from ..contract import CachePrepareParams, KVBackend
from .decoding import DEFAULT, Decoding
from .model_state import StateNamespaces, UnidentifiedModel
from .render import ChatTemplate, render, render_id
from .tokens import TokenPrefix, namespace_for

#: The manifest format of plain local KV entries (PyTorch and mlx-lm).
FORMAT = "spoolctl-local-kv/v1"


@dataclass(frozen=True)
class Plan:
    """What ``prepare`` works on: the key, entry and token prefix params map to.

    ``lead_segments``: segments before the first element (the tools block), which base
    selection must match exactly. ``extra``: the format's own data (e.g. VLM images).
    """

    params: CachePrepareParams
    key: str
    namespace: str
    entry_id: str
    prefix: TokenPrefix
    group: str
    elements: tuple[str, ...]
    lead_segments: int = 0
    extra: Any = field(default=None, compare=False, repr=False)
    #: The backend identity of the model state the plan was made in (None: the format's
    #: own, fixed identity); what its entry's manifest records and must match.
    identity: Mapping[str, str] | None = field(default=None, compare=False, repr=False)


@dataclass
class Loaded:
    """A cache in memory and the token prefix it covers."""

    cache: Any
    prefix: TokenPrefix


@dataclass(frozen=True)
class Prompt:
    """The whole prompt of a ``generate`` call: its token ids and the format's inputs."""

    tokens: list[int]
    extra: Any = field(default=None, compare=False, repr=False)


class EntryFormat(Protocol):
    """What the local engine asks of an entry format.

    * ``name`` / ``noun`` / ``label``: the manifest ``format`` marker, how a rejection
      names an entry ("not a local KV cache entry"), and the quarantine note's prefix.
    * ``kind``, ``identity``, ``namespace``: the store kind, the backend identity written
      to every manifest, and the default namespace.
    * ``bases``: whether entries may serve as bases of incremental prefills; if True the
      format also offers ``clone``, ``trim`` and ``extend``.
    * ``plan(params)``: the plan, or None when nothing can be cached.
    * ``entry_id(params)``: the entry ``params`` map to, cheaply (no prefill).
    * ``check(meta, plan, identity=None)``: the token prefix an entry's manifest meta
      records, after checking it belongs to this format and backend -- of the model state
      ``identity`` (a base of a plan: that plan's), else the plan's, else the format's --
      (and, with ``plan``, to that plan); ValueError on any mismatch.
    * ``prefill(plan)``: a cold cache of the plan's prefix.
    * ``serialize(cache, plan)``: ``(objects, layout)``; ``describe(plan)``: the format's
      own manifest ``meta`` and catalog ``index`` fields.
    * ``load(objects, meta, prefix, plan)``: the cache back from verified bytes; SpoolError
      or ValueError on any mismatch.
    * ``prompt(params, text)``: the whole prompt (every element, then ``text``) --
      the one place a format renders messages for ``generate``.
    * ``fit(loaded, prompt)``: ``(cache, cached tokens)`` to continue, or ``(None, 0)``.
    * ``run(cache, cached, prompt, max_new_tokens, decoding)``: new token ids and how
      many prompt tokens came from the cache (``decoding``: ``decoding.Decoding``).
    * ``decode(tokens)``: the text, or None.

    Optional (``LocalCacheController.restore`` / ``import_cache`` use them when present):
    ``new_cache()``, and ``adopt(cache, plan)`` -- a checked copy of a framework cache
    that must cover exactly the plan's prefix (ConfigError otherwise).
    """

    name: str
    noun: str
    label: str
    kind: str
    identity: dict[str, str]
    namespace: str
    bases: bool

    def plan(self, params: CachePrepareParams) -> Plan | None: ...

    def entry_id(self, params: CachePrepareParams) -> str: ...

    def check(self, meta: Mapping[str, Any], plan: Plan | None, *,
              identity: Mapping[str, str] | None = None) -> TokenPrefix: ...

    def prefill(self, plan: Plan) -> Any: ...

    def serialize(self, cache: Any, plan: Plan) -> tuple[dict[str, Any], dict]: ...

    def describe(self, plan: Plan) -> tuple[dict[str, Any], dict[str, Any]]: ...

    def load(self, objects: dict[str, memoryview], meta: Mapping[str, Any],
             prefix: TokenPrefix, plan: Plan | None) -> Any: ...

    def prompt(self, params: CachePrepareParams, text: str) -> Prompt: ...

    def fit(self, loaded: Loaded, prompt: Prompt) -> tuple[Any | None, int]: ...

    def run(self, cache: Any | None, cached: int, prompt: Prompt,
            max_new_tokens: int, decoding: Decoding = DEFAULT) -> tuple[list[int], int]: ...

    def decode(self, tokens: list[int]) -> str | None: ...


@runtime_checkable
class BaseFormat(Protocol):
    """The cache operations of a format whose entries serve as bases (``bases = True``)."""

    def clone(self, cache: Any) -> Any: ...

    def trim(self, cache: Any, keep: int) -> Any: ...

    def extend(self, cache: Any, tokens: list[int]) -> Any: ...


def base_ops(entry_format: EntryFormat) -> BaseFormat:
    """The base operations of a format with ``bases = True``; ConfigError if it lacks them."""
    if not isinstance(entry_format, BaseFormat):
        raise ConfigError(f"entry format {entry_format.name!r} sets bases but lacks clone(), "
                          "trim() or extend()",
                          fix="implement all three on the format, or set bases = False")
    return entry_format


@runtime_checkable
class ImportCheckingBackend(Protocol):
    """The optional ``KVBackend`` members ``import_cache`` needs."""

    def length(self, cache: Any) -> int: ...

    def check_import(self, cache: Any, tokens: list[int], *, full: bool = True) -> None: ...


class DecodingBackend(Protocol):
    """A ``KVBackend`` whose ``generate`` takes the optional ``decoding`` keyword."""

    def generate(self, cache: Any | None, cached_tokens: int, prompt_tokens: list[int],
                 max_new_tokens: int, *, decoding: Decoding) -> list[int]: ...


def takes_decoding(backend: KVBackend) -> TypeGuard[DecodingBackend]:
    """Whether ``backend.generate`` accepts ``decoding=`` (by name or ``**kwargs``)."""
    try:
        params = inspect.signature(backend.generate).parameters
    except (TypeError, ValueError):  # no signature to read: let the call itself decide
        return True
    return "decoding" in params or \
        any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def check_common(meta: Mapping[str, Any], *, name: str, noun: str,
                 identity: Mapping[str, str]) -> TokenPrefix:
    """The checks every format makes on manifest meta: format marker, backend identity,
    a layout, and a well-formed token prefix (ValueError otherwise)."""
    if meta.get("format") != name:
        raise ValueError(f"not {noun} (format {str(meta.get('format'))[:40]!r})")
    if meta.get("identity") != identity:
        raise ValueError("model identity in the manifest does not match the loaded model")
    if not isinstance(meta.get("layout"), dict):
        raise ValueError("manifest has no layout")
    return TokenPrefix.from_meta(meta)


class KVEntryFormat:
    """Plain KV cache entries of a ``KVBackend``. The prompt is rendered by
    ``render.render`` -- the model's chat template when it has one, else
    the plain format -- and tokenized per segment, so element prefixes line up with
    token prefixes (what base selection and incremental prefill rely on). Keys of
    template-rendered prompts also carry the template's identity."""

    name = FORMAT
    noun = "a local KV cache entry"
    bases = True

    def __init__(self, backend: KVBackend):
        self.backend = backend
        self.kind: str = backend.kind
        self.label = self.kind
        self.identity = dict(backend.identity())
        self.namespace = namespace_for(self.kind, self.identity)
        self._states = StateNamespaces(self.identity,
                                       lambda identity: namespace_for(self.kind, identity))
        state = getattr(backend, "model_state", None)
        self._model_state: Any = state if callable(state) else None
        get_template = getattr(backend, "chat_template", None)
        self.template: ChatTemplate | None = get_template() if callable(get_template) else None

    # -- prompts: the one rendering point -----------------------------------------------

    def _tokens(self, params: CachePrepareParams, text: str | None) -> tuple[list[list[int]], int]:
        """Token ids per segment and the number of lead segments: the cacheable prefix
        (``text is None``), or the whole prompt (every element, volatile ones included,
        then ``text``)."""
        segments = render(params, self.template, query=text)
        if not segments.texts:
            return [], segments.lead
        ids = self.backend.tokenize_segments(segments.texts) if segments.bos else \
            self.backend.tokenize_segments(segments.texts, bos=False)
        if len(ids) != len(segments.texts):
            raise ConfigError("the backend returned the wrong number of token lists",
                              fix="fix the backend's tokenize_segments()")
        return ids, segments.lead

    def _key(self, params: CachePrepareParams,
             prefix: TokenPrefix | None = None) -> tuple[str, str]:
        """(key, group): the params' own, plus -- if a chat template renders them -- the
        template's identity and the digest of the rendered prefix tokens (plain keys are
        the keys spoolctl always used).

        A template may render more than the params (``strftime_now``: today's date in the
        system header), so the same params can render other tokens tomorrow. Binding the
        rendered tokens makes that a different entry -- a plain miss, counted as
        ``prefix_moved`` -- instead of an entry whose tokens disagree with its key, which
        only damage can explain. The group stays the params' own, so the
        entry of yesterday's rendering is still found as a relative."""
        rid = render_id(params, self.template)
        key, group = params.key(), params.group_hash()
        if rid:
            if prefix is None:
                prefix = TokenPrefix.from_segments(self._tokens(params, None)[0])
            rendered = prefix.hashes[-1] if prefix.hashes else ""
            key = hash_parts(b"spoolctl-rendered/v2", key.encode(), rid.encode(),
                             rendered.encode())
            group = hash_parts(b"spoolctl-rendered/v1", group.encode(), rid.encode())
        return key, group

    def current(self) -> tuple[dict[str, str], str]:
        """(identity, namespace) of the model as it is now: the backend identity plus its
        ``model_state()`` (adapters acting on the base weights); ``UnidentifiedModel``
        when the backend cannot name the state (``model_state``)."""
        if self._model_state is None:
            return self.identity, self.namespace
        return self._states.of(self._model_state())

    def still(self, plan: Plan) -> bool:
        """Whether the model is still in the state ``plan`` was made in (a state switched
        during a prefill makes that cache nobody's)."""
        try:
            return self.current()[1] == plan.namespace
        except UnidentifiedModel:
            return False

    def plan(self, params: CachePrepareParams) -> Plan | None:
        identity, namespace = self.current()
        ids, lead = self._tokens(params, None)
        prefix = TokenPrefix.from_segments(ids)
        if not len(prefix):
            return None
        key, group = self._key(params, prefix)
        return Plan(params=params, key=key, namespace=namespace,
                    entry_id=entry_id_for(self.kind, namespace, key), prefix=prefix,
                    group=group, elements=tuple(params.element_hashes()),
                    lead_segments=lead, identity=identity)

    def entry_id(self, params: CachePrepareParams) -> str:
        return entry_id_for(self.kind, self.current()[1], self._key(params)[0])

    def prompt(self, params: CachePrepareParams, text: str) -> Prompt:
        segments, _ = self._tokens(params, text)
        if not segments:
            raise ConfigError("the prompt is empty", fix="pass instructions, data or a prompt")
        tokens = [t for seg in segments for t in seg]
        if not tokens:
            raise ConfigError("the prompt tokenizes to nothing", fix="pass a non-empty prompt")
        return Prompt(tokens)

    # -- entries ---------------------------------------------------------------------------

    def check(self, meta: Mapping[str, Any], plan: Plan | None, *,
              identity: Mapping[str, str] | None = None) -> TokenPrefix:
        want = identity or (plan.identity if plan is not None else None) or self.identity
        return check_common(meta, name=self.name, noun=self.noun, identity=want)

    def prefill(self, plan: Plan) -> Any:
        return self.backend.prefill(self.backend.new_cache(), list(plan.prefix.tokens))

    def serialize(self, cache: Any, plan: Plan) -> tuple[dict[str, Any], dict]:
        return self.backend.serialize(cache, len(plan.prefix))

    def describe(self, plan: Plan) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"lead_segments": plan.lead_segments}, {}

    def load(self, objects: dict[str, memoryview], meta: Mapping[str, Any],
             prefix: TokenPrefix, plan: Plan | None) -> Any:
        return self.backend.deserialize(objects, dict(meta["layout"]), len(prefix))

    # -- bases and interop -------------------------------------------------------------------

    def clone(self, cache: Any) -> Any:
        clone = getattr(self.backend, "clone", None)
        return clone(cache) if clone is not None else copy.deepcopy(cache)

    @property
    def trimmable(self) -> bool:
        """Whether every cache of the backend can be cut back to a shorter prefix (full
        attention); if not, bases serve only plans that extend them whole."""
        return bool(getattr(self.backend, "trimmable", True))

    @property
    def extends_by_token(self) -> bool:
        """Whether extending a cache runs one token per forward (a model whose multi-token
        forward ignores a cached recurrent state): a cold prefill is then cheaper than
        extending a copy of a shorter state."""
        return bool(getattr(self.backend, "extends_by_token", False))

    def recompute_cheaper(self, held: int, new: int) -> bool:
        """Whether the backend estimates a cold prefill of ``held + new`` tokens cheaper
        than extending a stored state of ``held`` tokens by ``new`` (False: no estimate)."""
        rule = getattr(self.backend, "recompute_cheaper", None)
        return bool(rule(held, new)) if callable(rule) else False

    def trim(self, cache: Any, keep: int) -> Any:
        return self.backend.trim(cache, keep)

    def extend(self, cache: Any, tokens: list[int]) -> Any:
        return self.backend.prefill(cache, tokens)

    def new_cache(self) -> Any:
        return self.backend.new_cache()

    def adopt(self, cache: Any, plan: Plan, *, full: bool = True) -> Any:
        """A checked copy of a framework cache that must hold exactly the plan's prefix:
        shapes, dtype and length (the backend's ``serialize`` checks), then its K/V
        recomputed from the tokens (``check_import``: every position when ``full``, else
        four sampled positions)."""
        tokens = list(plan.prefix.tokens)
        backend = self.backend
        if not isinstance(backend, ImportCheckingBackend):
            raise ConfigError(f"the {self.kind} backend cannot check an imported cache",
                              fix="implement length() and check_import() on the backend")
        try:
            own = self.clone(cache)
            length = backend.length(own)
        except Exception as exc:
            raise ConfigError(f"not a cache of this model: {str(exc)[:200]}",
                              fix="pass the framework's own cache object (transformers "
                                  "DynamicCache, mlx-lm prompt cache list)") from None
        if length != len(tokens):
            raise ConfigError(f"the cache holds {length} tokens, the cacheable prefix of these "
                              f"params {len(tokens)}",
                              fix="prefill exactly ctl.prefix_tokens(params) into it")
        try:
            self.backend.serialize(own, len(tokens))  # shapes, layers, dtype
            backend.check_import(own, tokens, full=full)
        except ValueError as exc:
            raise ConfigError(f"the cache does not hold these tokens for this model: "
                              f"{str(exc)[:200]}",
                              fix="prefill exactly ctl.prefix_tokens(params) with this model "
                                  "(same dtype)") from None
        return own

    # -- generation ----------------------------------------------------------------------------

    def fit(self, loaded: Loaded, prompt: Prompt) -> tuple[Any | None, int]:
        """The cache and how many prompt tokens it covers, keeping at least one prompt
        token uncached (decoding needs the logits of the last prompt token). A failed
        trim raises (the engine logs it and runs cold)."""
        if not loaded.prefix.is_prefix_of(prompt.tokens):
            return None, 0
        cached = len(loaded.prefix)
        if cached < len(prompt.tokens):
            return loaded.cache, cached
        keep = len(prompt.tokens) - 1
        if keep <= 0:
            return None, 0
        return self.backend.trim(self.clone(loaded.cache), keep), keep

    def run(self, cache: Any | None, cached: int, prompt: Prompt, max_new_tokens: int,
            decoding: Decoding = DEFAULT) -> tuple[list[int], int]:
        backend = self.backend
        if decoding.is_default:  # every KVBackend decodes with its model's defaults
            out = backend.generate(cache, cached, prompt.tokens, max_new_tokens)
        elif takes_decoding(backend):
            out = backend.generate(cache, cached, prompt.tokens, max_new_tokens,
                                   decoding=decoding)
        else:
            raise ConfigError(f"the {self.kind} backend's generate() takes no decoding options",
                              fix="leave out sampling, streamer and framework options, or "
                                  "add a decoding= parameter to the backend's generate()")
        return list(out), cached if cache is not None else 0

    def decode(self, tokens: list[int]) -> str | None:
        decode = getattr(self.backend, "decode", None)
        return decode(tokens) if decode is not None else None
