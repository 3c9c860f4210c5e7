"""The prompt-cache controller contract: parameters, handles, results, the protocols.

Pure data and hashing only (no framework imports). Every controller --
PyTorch, MLX, mlx-vlm, Google GenAI -- takes ``CachePrepareParams`` and returns a
``CacheHandle``; the same parameters always derive the same key; every
``generate`` returns a ``GenerateResult``. ``PromptCacheController`` is what a
controller offers, ``KVBackend`` what a framework adapter gives the local engine
(``spoolctl.controllers.local.engine``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from spoolctl.errors import ConfigError
from spoolctl.store import hash_parts

CacheHint = Literal["static", "immutable", "volatile"]
CACHE_HINTS: frozenset[str] = frozenset({"static", "immutable", "volatile"})
ROLES: frozenset[str] = frozenset({"system", "user", "assistant", "tool", "model"})
EFFORTS: frozenset[str] = frozenset({"low", "medium", "high"})
KEY_SCHEMA = b"spoolctl-prepare/v1"


@dataclass(frozen=True)
class Element:
    """One piece of a prompt: plain text (``role=None``) or a chat message.

    ``cache`` is the element's cache hint: ``static`` and ``immutable`` elements
    may be part of a cached prefix; a ``volatile`` element (and everything after
    it) never is.
    """

    content: str
    role: str | None = None
    name: str | None = None
    cache: CacheHint = "static"

    def __post_init__(self) -> None:
        if not isinstance(self.content, str):
            raise ConfigError(f"element content must be a string, not "
                              f"{type(self.content).__name__}",
                              fix="pass text, or a message dict with a 'content' string")
        if not self.content:
            # An empty element would cache nothing but a BOS token under its own key.
            raise ConfigError("element content is empty",
                              fix="drop the element, or give it some text")
        if self.role is not None and (not isinstance(self.role, str) or self.role not in ROLES):
            raise ConfigError(f"unknown element role {self.role!r}",
                              fix=f"use one of: {', '.join(sorted(ROLES))}")
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ConfigError(f"element name must be a non-empty string, not {self.name!r}",
                              fix="pass a name string or leave it out")
        if not isinstance(self.cache, str) or self.cache not in CACHE_HINTS:
            raise ConfigError(f"unknown cache hint {self.cache!r}",
                              fix="use 'static', 'immutable' or 'volatile'")

    @classmethod
    def coerce(cls, value: Element | str | Mapping[str, Any]) -> Element:
        """Accept an Element, a string, or a chat message dict
        ``{role, content[, name, cache]}``."""
        if isinstance(value, Element):
            return value
        if isinstance(value, str):
            return cls(content=value)
        if isinstance(value, Mapping):
            unknown = set(value) - {"role", "content", "name", "cache"}
            if unknown:
                raise ConfigError(f"unknown message fields {sorted(unknown)}",
                                  fix="a message has role, content and optional name and cache")
            if "content" not in value:
                raise ConfigError("a message has no 'content'",
                                  fix='use {"role": "user", "content": "..."}')
            return cls(content=value["content"], role=value.get("role"),
                       name=value.get("name"), cache=value.get("cache", "static"))
        raise ConfigError(f"cannot use a {type(value).__name__} as a prompt element",
                          fix="pass a string or a message dict")

    @property
    def digest(self) -> str:
        return hash_parts(b"element/v1", (self.role or "").encode(),
                          (self.name or "").encode(), self.content.encode())


@dataclass(frozen=True)
class ToolDefinition:
    """A tool (function) the model may call; hashed by its canonical JSON."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("tool name must be a non-empty string", fix="name every tool")
        if not isinstance(self.description, str):
            raise ConfigError(f"tool {self.name!r}: description must be a string",
                              fix="pass a description string or leave it out")
        if not isinstance(self.parameters, Mapping):
            raise ConfigError(f"tool {self.name!r}: parameters must be a JSON schema object",
                              fix='pass e.g. {"type": "object", "properties": {...}}')
        try:
            _canonical(dict(self.parameters))
        except (TypeError, ValueError):
            raise ConfigError(f"tool {self.name!r}: parameters are not JSON-serialisable",
                              fix="use strings, numbers, booleans, lists and dicts") from None

    @classmethod
    def coerce(cls, value: ToolDefinition | Mapping[str, Any]) -> ToolDefinition:
        """Accept a ToolDefinition, ``{name, description, parameters}`` or the OpenAI /
        transformers form ``{"type": "function", "function": {name, ...}}``."""
        if isinstance(value, ToolDefinition):
            return value
        if isinstance(value, Mapping):
            spec: Mapping[str, Any] = value
            if spec.get("type") == "function" and isinstance(spec.get("function"), Mapping):
                extra = set(spec) - {"type", "function"}
                if extra:
                    raise ConfigError(f"unknown tool fields {sorted(extra)}",
                                      fix='use {"type": "function", "function": {...}}')
                spec = spec["function"]
            unknown = set(spec) - {"name", "description", "parameters"}
            if unknown:
                raise ConfigError(f"unknown tool fields {sorted(unknown)}",
                                  fix="a tool has name, description and parameters")
            return cls(name=spec.get("name", ""), description=spec.get("description", ""),
                       parameters=spec.get("parameters", {}))
        raise ConfigError(f"a tool must be a ToolDefinition or a dict, not {type(value).__name__}",
                          fix="pass {name, description, parameters}")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description,
                "parameters": dict(self.parameters)}


@dataclass(frozen=True)
class ImageInput:
    """An image of a vision-language prompt (used by the mlx-vlm controller only).

    ``source`` is a local file path; ``before`` is the index, in instructions-then-data
    order, of the element the image is placed in front of (``len(elements)`` = after
    the last element). The key covers source and position; the VLM controller adds
    the identity of the decoded, resized pixels, so a changed file never reuses an entry.
    """

    source: str
    before: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ConfigError("image source must be a non-empty file path",
                              fix="pass the path of a PNG/JPEG file")
        if not isinstance(self.before, int) or isinstance(self.before, bool) or self.before < 0:
            raise ConfigError(f"image position must be an integer >= 0, not {self.before!r}",
                              fix="pass the index of the element the image precedes")

    @classmethod
    def coerce(cls, value: ImageInput | str | Mapping[str, Any]) -> ImageInput:
        """Accept an ImageInput, a path (placed before the first element) or
        ``{"source": PATH, "before": N}``."""
        if isinstance(value, ImageInput):
            return value
        if isinstance(value, str):
            return cls(source=value)
        if isinstance(value, Mapping):
            unknown = set(value) - {"source", "before"}
            if unknown:
                raise ConfigError(f"unknown image fields {sorted(unknown)}",
                                  fix="an image has a 'source' path and an optional 'before'")
            return cls(source=value.get("source", ""), before=value.get("before", 0))
        raise ConfigError(f"cannot use a {type(value).__name__} as an image",
                          fix="pass a file path or {'source': PATH, 'before': N}")


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


#: ``formatter_options`` keys and what they mean (local controllers).
#: ``template``: "auto" (the tokenizer's chat template when it has one, else plain),
#: "chat" (require the chat template), "plain" (``role: content`` lines).
#: ``chat_template_kwargs``: extra variables handed to the chat template
#: (e.g. ``{"enable_thinking": False}``).
FORMATTER_OPTIONS: frozenset[str] = frozenset({"template", "chat_template_kwargs"})
TEMPLATES: tuple[str, ...] = ("auto", "chat", "plain")


def _sequence(value: Any, what: str, item: str) -> tuple[Any, ...]:
    """A list-like field as a tuple; a lone string, dict or item is refused, not split
    into characters or keys."""
    if isinstance(value, (str, bytes, Mapping, Element, ToolDefinition, ImageInput)):
        raise ConfigError(f"{what} must be a list of {item}s, not a single "
                          f"{type(value).__name__}",
                          fix=f"wrap it in a list: {what}=[...]")
    try:
        return tuple(value)
    except TypeError:
        raise ConfigError(f"{what} must be a list of {item}s, not {type(value).__name__}",
                          fix=f"pass {what}=[...]") from None


def _formatter_options(value: Any) -> dict[str, Any]:
    """Validate ``formatter_options`` and drop defaults, so ``{}`` and
    ``{"template": "auto"}`` are one key."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"formatter_options must be a dict, not {type(value).__name__}",
                          fix='pass e.g. {"template": "plain"}')
    unknown = set(value) - FORMATTER_OPTIONS
    if unknown:
        raise ConfigError(f"unknown formatter option(s) {sorted(map(str, unknown))}",
                          fix=f"use only: {', '.join(sorted(FORMATTER_OPTIONS))}")
    out = dict(value)
    template = out.get("template", "auto")
    if template not in TEMPLATES:
        raise ConfigError(f"unknown template {template!r} in formatter_options",
                          fix=f"use one of: {', '.join(TEMPLATES)}")
    kwargs = out.get("chat_template_kwargs", {})
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ConfigError("formatter_options['chat_template_kwargs'] must be a dict with "
                          "string keys", fix='pass e.g. {"enable_thinking": False}')
    try:
        _canonical(out)
    except (TypeError, ValueError):
        raise ConfigError("formatter_options must be JSON-serialisable",
                          fix="use strings, numbers, booleans, lists and dicts") from None
    if template == "auto":
        out.pop("template", None)
    if not kwargs:
        out.pop("chat_template_kwargs", None)
    return out


@dataclass(frozen=True)
class CachePrepareParams:
    """What to prepare a cache for. Validated when built: one ConfigError naming the
    field and the fix; list fields are coerced to tuples of typed values.

    ``model``: for the local controllers the model directory (any spelling of its path)
    or the controller's ``model_id``; None means "the controller's model". The local
    controllers normalise it to their ``model_id`` (so ``/m/llama`` and ``/m/llama/``
    are one key) and refuse another model. Hosted controllers need the server's model
    name. ``formatter_options``: see ``FORMATTER_OPTIONS``.
    """

    model: str | None = None
    instructions: Sequence[Element] = ()
    data: Sequence[Element] = ()
    tools: Sequence[ToolDefinition] = ()
    reasoning_effort: str | None = None
    read_only: bool = False
    formatter_options: Mapping[str, Any] = field(default_factory=dict)
    #: Images of a vision-language prompt (mlx-vlm controller); other controllers
    #: ignore them. Part of the key only when present, so text keys are unchanged.
    images: Sequence[ImageInput] = ()
    #: Longest image edge (pixels) before the model's own preprocessing; None = as is.
    max_image_size: int | None = None

    def __post_init__(self) -> None:
        model = self.model
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        if model is not None and (not isinstance(model, str) or not model.strip()):
            raise ConfigError(f"model must be a non-empty string (or None for the "
                              f"controller's model), not {self.model!r}",
                              fix="pass the model directory, its model id, or leave it out")
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "instructions", tuple(
            Element.coerce(e) for e in _sequence(self.instructions, "instructions", "element")))
        object.__setattr__(self, "data", tuple(
            Element.coerce(e) for e in _sequence(self.data, "data", "element")))
        tools = tuple(ToolDefinition.coerce(t) for t in _sequence(self.tools, "tools", "tool"))
        if len({t.name for t in tools}) != len(tools):
            raise ConfigError("duplicate tool names", fix="give every tool a unique name")
        object.__setattr__(self, "tools", tools)
        if self.reasoning_effort is not None and (not isinstance(self.reasoning_effort, str)
                                                  or self.reasoning_effort not in EFFORTS):
            raise ConfigError(f"unknown reasoning_effort {self.reasoning_effort!r}",
                              fix="use 'low', 'medium' or 'high'")
        if not isinstance(self.read_only, bool):
            raise ConfigError(f"read_only must be True or False, not {self.read_only!r}",
                              fix="pass read_only=True or leave it out")
        object.__setattr__(self, "images", tuple(
            ImageInput.coerce(i) for i in _sequence(self.images, "images", "image")))
        if self.max_image_size is not None and (
                not isinstance(self.max_image_size, int) or isinstance(self.max_image_size, bool)
                or self.max_image_size < 1):
            raise ConfigError(f"max_image_size must be a positive integer, not "
                              f"{self.max_image_size!r}", fix="pass e.g. 448, or None")
        object.__setattr__(self, "formatter_options", _formatter_options(self.formatter_options))

    @property
    def template(self) -> str:
        """The ``formatter_options`` template choice: "auto", "chat" or "plain"."""
        return str(self.formatter_options.get("template", "auto"))

    @property
    def chat_template_kwargs(self) -> dict[str, Any]:
        return dict(self.formatter_options.get("chat_template_kwargs", {}))

    def require_model(self) -> str:
        """``model``; ConfigError when it is not set."""
        if self.model is None:
            raise ConfigError("params.model is not set",
                              fix="a local controller fills it in (prepare through it); "
                                  "hosted controllers need the server's model name")
        return self.model

    @property
    def tools_hash(self) -> str:
        ordered = sorted((t.to_json() for t in self.tools), key=lambda t: t["name"])
        return hash_parts(b"tools/v1", _canonical(ordered))

    @property
    def formatter_hash(self) -> str:
        """Digest of the formatter options that shape the text. The ``template`` choice is
        left out: what it resolved to (plain, or which chat template) is added to the key
        by the local controllers, which know the model (``render.render_id``)."""
        options = {k: v for k, v in self.formatter_options.items() if k != "template"}
        return hash_parts(b"formatter/v1", _canonical(options))

    def cacheable(self) -> tuple[tuple[Element, ...], tuple[Element, ...]]:
        """The cacheable prefix: leading non-volatile instructions, then data (if all
        instructions are cacheable), stopping at the first volatile element."""
        instr: list[Element] = []
        for e in self.instructions:
            if e.cache == "volatile":
                return tuple(instr), ()
            instr.append(e)
        data: list[Element] = []
        for e in self.data:
            if e.cache == "volatile":
                break
            data.append(e)
        return tuple(instr), tuple(data)

    def includes(self) -> Includes:
        instr, data = self.cacheable()
        return Includes(
            instructions=bool(self.instructions) and len(instr) == len(self.instructions),
            data_element_count=len(data),
            tools=bool(self.tools),
        )

    def element_hashes(self) -> list[str]:
        """Per-element digests of the cacheable prefix, instructions then data, each
        tagged with its section so moving an element between sections changes it."""
        instr, data = self.cacheable()
        return [hash_parts(b"i", e.digest.encode()) for e in instr] + \
               [hash_parts(b"d", e.digest.encode()) for e in data]

    def group_hash(self) -> str:
        """What must match for one entry to serve as another's base: everything but
        the elements (model, tools, formatter options, reasoning effort)."""
        return hash_parts(KEY_SCHEMA, b"group", self.require_model().encode(),
                          self.tools_hash.encode(),
                          self.formatter_hash.encode(), (self.reasoning_effort or "").encode())

    @property
    def images_hash(self) -> str:
        """Digest of the image sources, positions and resize setting ("" if no images)."""
        if not self.images:
            return ""
        return hash_parts(b"images/v1", _canonical(
            {"images": [[i.source, i.before] for i in self.images],
             "max_image_size": self.max_image_size}))

    def key(self) -> str:
        """The cache key of these parameters (64 hex)."""
        images = (self.images_hash.encode(),) if self.images else ()
        return hash_parts(KEY_SCHEMA, self.group_hash().encode(),
                          *(h.encode() for h in self.element_hashes()), *images)

    def has_cacheable_prefix(self) -> bool:
        instr, data = self.cacheable()
        return bool(instr or data or self.tools)


@dataclass(frozen=True)
class Includes:
    """What a handle's cache already contains (so a driver does not send it twice)."""

    instructions: bool = False
    data_element_count: int = 0
    tools: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"instructions": self.instructions,
                "data_element_count": self.data_element_count, "tools": self.tools}


@dataclass(frozen=True)
class CacheHandle:
    """A prepared cache. ``ref is None`` is the empty handle: no cache, run cold.

    ``cached_tokens`` is how many prompt tokens the cache covers (0 for hosted
    caches until the server reports it). What the ``prepare`` call did:
    ``computed_tokens`` were prefilled by it, ``written_tokens`` of those were committed
    to the store (0 when the commit failed and the cache lives in memory only),
    ``reused_tokens`` came from a base entry. ``source`` says where the cache came from:
    "none" (no cache: nothing cacheable, or a read-only miss), "memory", "disk",
    "coalesced" (another caller's prefill), "cold", "incremental", "import"
    (hosted controllers may use their own words).

    ``prepare_id`` identifies the ``prepare`` call (not compared): the controller that
    made the handle knows its params (so ``generate(handle)`` works for an empty handle
    too) and reports the call's work in the usage of the first ``generate`` using it.
    """

    ref: str | None = None
    trim_tokens: int | None = None
    includes: Includes = field(default_factory=Includes)
    supersedes: str | None = None
    cached_tokens: int = 0
    written_tokens: int = 0
    reused_tokens: int = 0
    source: str = "none"
    computed_tokens: int = 0
    prepare_id: int | None = field(default=None, compare=False)

    @classmethod
    def empty(cls) -> CacheHandle:
        return cls()

    def __bool__(self) -> bool:
        return self.ref is not None


@dataclass
class Usage:
    """Token usage of one generate call. Cache tokens are reported separately and are
    NOT subtracted from ``prompt_tokens``.

    ``cache_read_tokens``: prompt tokens served from a cache instead of being computed.
    Local controllers split them into ``cache_memory_tokens`` (a cache already in this
    process) and ``cache_disk_tokens`` (read and verified from the store by this call);
    hosted controllers report the server's figure. ``computed_tokens`` is the rest of
    the prompt (the model ran it). ``cache_write_tokens``: tokens this call newly
    committed to the cache (for local controllers, the prefix its ``prepare`` prefilled
    and stored). A prepare's work counts once: in the first ``generate`` that uses its
    handle (or in ``generate(params)``, which prepares itself).
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    cache_memory_tokens: int = 0
    cache_disk_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def computed_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cache_read_tokens)

    def to_json(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens, "cache_read_tokens": self.cache_read_tokens,
                "cache_write_tokens": self.cache_write_tokens,
                "cache_memory_tokens": self.cache_memory_tokens,
                "cache_disk_tokens": self.cache_disk_tokens,
                "computed_tokens": self.computed_tokens}


@dataclass(frozen=True)
class GenerateResult:
    """What every controller's ``generate`` returns.

    ``usage``: token counts of the call. ``handle``: the handle the call used (the
    GenAI controller returns the empty handle when the server had lost the cache and
    the request re-ran cold). ``text``: the answer (None when a local backend cannot
    decode). ``tokens``: the new token ids (local controllers; empty for hosted ones).
    ``response``: the SDK's response object (hosted controllers; None locally).
    """

    usage: Usage
    handle: CacheHandle
    text: str | None = None
    tokens: list[int] = field(default_factory=list)
    response: Any = field(default=None, repr=False)


@runtime_checkable
class PromptCacheController(Protocol):
    """The contract every controller implements.

    * ``prepare(params)``: same params -> same entry (memory or disk); concurrent
      identical calls are coalesced; ``params.read_only`` never writes.
    * ``release(ref)``: a hint; out of reuse at once, bytes deleted later.
    * ``close()``: wait for in-flight work, delete this controller's released
      entries (and a managed store entirely).
    * ``record_query()``: count one query served (statistics).
    """

    def prepare(self, params: CachePrepareParams) -> CacheHandle: ...

    def release(self, ref: str) -> None: ...

    def close(self) -> None: ...

    def record_query(self) -> None: ...

    def __enter__(self) -> PromptCacheController: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class KVBackend(Protocol):
    """What a framework adapter gives the local engine. All token ids are plain ``int``.

    * ``kind``: the store entry kind ("pytorch" | "mlx").
    * ``identity()``: model id/path + revision/weights digest, dtype, device, framework
      versions. Hashed into the namespace and written to every manifest; two backends
      whose caches are not interchangeable must differ here.
    * ``tokenize_segments(segments, *, bos=True)``: one id list per text segment (no
      special tokens except, with ``bos``, a BOS at the start of the first segment).
    * ``new_cache()``: an empty cache.
    * ``prefill(cache, tokens)``: extend ``cache`` (empty, loaded or trimmed) by ``tokens``
      (non-empty) and return it.
    * ``trim(cache, keep_tokens)``: keep the first ``keep_tokens`` (0 < keep <= length) and
      return the cache (may be the same object, modified).
    * ``serialize(cache, token_count)``: ``(objects, layout)``, the payload objects (name ->
      bytes) and a JSON-able layout description for ``deserialize``. Never pickle.
    * ``deserialize(objects, layout, token_count)``: a cache covering exactly
      ``token_count`` tokens; raise ``SpoolError`` or ``ValueError`` on ANY mismatch with the
      loaded model (layer count, heads, head dim, dtype, length...).
    * ``generate(cache, cached_tokens, prompt_tokens, max_new_tokens[, decoding=])``:
      ``prompt_tokens`` is the whole prompt; ``cache`` (or None) covers its first
      ``cached_tokens`` (always < len(prompt_tokens)). Must leave ``cache`` unchanged
      (clone first if decoding extends it in place) and return only the new token ids.
      Greedy; ``decoding`` (a ``decoding.Decoding``) is passed only when the caller asks
      for sampling, a streamer or framework kwargs.

    Optional: ``clone(cache)`` (default ``copy.deepcopy``), ``decode(tokens) -> str``,
    ``chat_template() -> render.ChatTemplate | None`` (the model's chat template),
    ``model_id`` / ``model_path`` (what ``params.model`` is normalised to and the
    directory any spelling of it resolves to), ``length(cache)`` and
    ``check_import(cache, tokens, *, full)`` (for ``import_cache``).
    """

    kind: str

    def identity(self) -> dict[str, str]: ...

    def tokenize_segments(self, segments: list[str], *, bos: bool = True
                          ) -> list[list[int]]: ...

    def new_cache(self) -> Any: ...

    def prefill(self, cache: Any, tokens: list[int]) -> Any: ...

    def trim(self, cache: Any, keep_tokens: int) -> Any: ...

    def serialize(
        self, cache: Any, token_count: int
    ) -> tuple[dict[str, bytes | memoryview], dict]: ...

    def deserialize(
        self, objects: dict[str, memoryview], layout: dict, token_count: int
    ) -> Any: ...

    def generate(
        self, cache: Any | None, cached_tokens: int, prompt_tokens: list[int], max_new_tokens: int
    ) -> list[int]: ...


def render_segments(params: CachePrepareParams, *, include_volatile: bool = True) -> list[str]:
    """The prompt in the plain format as text segments, one per element, in prompt order
    (tools first, then instructions, then data). Tokenizing each segment separately and
    concatenating the ids gives token prefixes that line up with element prefixes.

    The local controllers use it for models without a chat template, or with
    ``formatter_options={"template": "plain"}`` (``render.py``).
    """
    segments: list[str] = []
    if params.tools:
        ordered = sorted((t.to_json() for t in params.tools), key=lambda t: t["name"])
        segments.append("Tools:\n" + json.dumps(ordered, sort_keys=True) + "\n")
    if include_volatile:
        elements = [*params.instructions, *params.data]
    else:
        instr, data = params.cacheable()
        elements = [*instr, *data]
    for e in elements:
        prefix = f"{e.role}: " if e.role else ""
        segments.append(f"{prefix}{e.content}\n")
    return segments
