"""Using prepared caches: ``generate``, and the interop calls of the local controllers.

The half of ``LocalCacheController`` that consumes what ``prepare`` made (``engine.py``
makes it): a part the controller is composed of. ``CacheUse`` receives a
``UseContext`` -- the entry format and the few engine calls it needs (prepare, the params
and work of a handle, its loaded cache, commit of an imported cache, the open/writable
guards) -- never the controller, and the controller forwards its public methods here.

* ``generate``: decoding settings (``decoding.Decoding``: sampling, a streamer,
  framework kwargs), the target rule (``targets.py``), per-call usage
  (``usage.py``).
* ``prompt_tokens`` / ``prefix_tokens``: the token ids spoolctl runs and caches for a
  query, rendered exactly as ``generate`` renders them (chat template included).
* ``restore``: the cache of a handle in the framework's own type (transformers
  ``DynamicCache``, mlx-lm's list of cache objects), an independent copy, for the
  framework's own generate.
* ``import_cache``: the other way: a cache the framework computed becomes the store
  entry of some params, after its length and shapes check and its K/V is recomputed from
  the tokens (every position by default, four with ``check="sample"``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from spoolctl.store import ConfigError

from ..contract import CacheHandle, CachePrepareParams, GenerateResult
from ..logsafe import reason
from ..targets import FOREIGN_HANDLE, resolve_target
from .decoding import Decoding
from .entry_format import EntryFormat, Loaded, Plan, Prompt
from .model_state import UnidentifiedModel
from .usage import PrepareWork, call_usage

log = logging.getLogger("spoolctl.controllers")

#: ``import_cache(check=...)``: recompute every position, or four sampled ones.
IMPORT_CHECKS = ("full", "sample")
UNFIT = ("the prepared cache is not where this prompt starts as rendered (the chat template "
         "renders the cached messages differently once more follow); running cold")


@dataclass(frozen=True)
class Restored:
    """A prepared cache in the framework's own type (see ``CacheUse.restore``).

    ``cache`` covers exactly ``tokens`` (the cacheable prefix as spoolctl tokenized it;
    empty for an empty handle, with a fresh empty cache). It is an independent copy:
    the framework's generate may extend it in place without touching the stored entry.
    """

    cache: Any = field(repr=False)
    tokens: list[int]
    handle: CacheHandle


@dataclass(frozen=True)
class UseContext:
    """What ``CacheUse`` uses of its controller (see the module docstring).

    ``loaded(handle, params)``: the handle's loaded cache (memory, else reloaded from disk)
    and whether it was reloaded, or ``(None, False)``. ``store_imported(params, plan,
    cache)``: commit a checked, copied cache as the entry of ``plan`` and return its
    handle. ``check_writable(what)``: ConfigError on a closed or read-only controller."""

    format: EntryFormat
    check_open: Callable[[], None]
    check_writable: Callable[[str], None]
    normalize: Callable[[Any], CachePrepareParams]
    prepare: Callable[[CachePrepareParams], CacheHandle]
    known: Callable[[CacheHandle], CachePrepareParams | None]
    take_work: Callable[[CacheHandle], PrepareWork | None]
    loaded: Callable[[CacheHandle, CachePrepareParams], tuple[Loaded | None, bool]]
    record_query: Callable[[], None]
    store_imported: Callable[[CachePrepareParams, Plan, Any], CacheHandle]


class CacheUse:
    """``generate`` and the interop calls (see the module docstring)."""

    def __init__(self, ctx: UseContext):
        self._ctx = ctx
        self._warned_unfit = False

    @property
    def format(self) -> EntryFormat:
        return self._ctx.format

    def generate(
        self,
        target: CachePrepareParams | CacheHandle,
        prompt: str = "",
        max_new_tokens: int = 32,
        *,
        params: CachePrepareParams | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        streamer: Any = None,
        generate_kwargs: Mapping[str, Any] | None = None,
    ) -> GenerateResult:
        """Generate after the full prompt: every element of the params (volatile ones
        included; images too for VLM prompts), then ``prompt`` (the user's turn under a
        chat template).

        ``target`` is the params (prepared here) or a handle; which params and which
        cache a call runs with follows ``targets.resolve_target``:
        ``params=`` is the query when given, a handle of other params is refused. The
        cache is used only if its tokens are a prefix of the prompt; if using it fails,
        the request is re-run cold (``usage.cache_read_tokens = 0``).

        Decoding settings left out are the framework's defaults for the model, as its own
        generate with no arguments (transformers: the model's ``generation_config``, e.g.
        its ``do_sample``, temperature and repetition penalty; mlx-lm: greedy).
        ``temperature=0`` is greedy; ``temperature > 0`` samples (with ``top_p`` /
        ``top_k``), seeded by ``seed``; ``streamer`` is a transformers-style streamer
        (``put``/``end``, e.g. ``TextStreamer``); ``generate_kwargs`` go to the
        framework's own generate call verbatim (see ``decoding.py``).
        """
        self._ctx.check_open()
        if not isinstance(prompt, str):
            raise ConfigError(f"prompt must be a string, not {type(prompt).__name__}",
                              fix="pass the user's text; put messages in the params")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, not {max_new_tokens!r}",
                              fix="ask for at least one token")
        decoding = Decoding(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            streamer=streamer, extra=generate_kwargs or {})
        query, handle = self._resolve(target, params)
        if handle is None:
            handle = self._ctx.prepare(query)
        rendered = self.format.prompt(query, prompt)
        state = self._state_of(handle, query)
        belongs = state is not False
        work = self._ctx.take_work(handle) if belongs else None
        cache, cached, reloaded = self._cache_for(handle, query, rendered, state)
        out: list[int] | None = None
        if cache is not None:
            try:
                out, cached = self.format.run(cache, cached, rendered, max_new_tokens, decoding)
            except ConfigError:
                raise
            except Exception as exc:
                log.warning("generation from the cache failed, rerunning cold: %s", reason(exc))
        if out is None:
            out, cached = self.format.run(None, 0, rendered, max_new_tokens, decoding)
        self._ctx.record_query()
        usage = call_usage(work, cached=cached, prompt_tokens=len(rendered.tokens),
                           completion_tokens=len(out), reloaded=reloaded)
        return GenerateResult(usage=usage, handle=handle, text=self.format.decode(out),
                              tokens=list(out))

    def _resolve(self, target: Any, params: Any
                 ) -> tuple[CachePrepareParams, CacheHandle | None]:
        if isinstance(target, CachePrepareParams):
            target = self._ctx.normalize(target)
        if params is not None:
            params = self._ctx.normalize(params)
        return resolve_target(target, params, self._ctx.known)

    def _state_of(self, handle: CacheHandle, params: CachePrepareParams) -> bool | None:
        """Whether ``handle`` is the entry of ``params`` for the model as it is now: True,
        False (prepared for other params), or None (prepared for this query in another
        model state -- adapters switched since -- or the model cannot be identified now)."""
        if handle.ref is None:
            return True
        try:
            if handle.ref == self.format.entry_id(params):
                return True
        except UnidentifiedModel:
            return None
        return None if self._ctx.known(handle) == params else False

    def _cache_for(self, handle: CacheHandle,
                   params: CachePrepareParams, prompt: Prompt,
                   state: bool | None) -> tuple[Any | None, int, bool]:
        """``(cache, cached tokens, reloaded from disk)`` to continue from."""
        if handle.ref is None or state is None:
            return None, 0, False
        if not state:
            log.warning(FOREIGN_HANDLE)
            return None, 0, False
        loaded, reloaded = self._ctx.loaded(handle, params)
        if loaded is None:
            return None, 0, False
        try:
            cache, cached = self.format.fit(loaded, prompt)
        except Exception as exc:
            log.warning("could not fit the cache to this prompt, running cold: %s", reason(exc))
            return None, 0, False
        if cache is None and not self._warned_unfit:
            self._warned_unfit = True
            log.warning(UNFIT)
        return cache, cached, reloaded

    # -- interop ----------------------------------------------------------------------------

    def prompt_tokens(self, target: CachePrepareParams | CacheHandle,
                      prompt: str = "", *, params: CachePrepareParams | None = None
                      ) -> list[int]:
        """The token ids ``generate(target, prompt)`` runs: the whole prompt, rendered
        (chat template included) and tokenized exactly as ``generate`` does. They start
        with the prefix tokens of the target's cache."""
        self._ctx.check_open()
        query, _ = self._resolve(target, params)
        return list(self.format.prompt(query, prompt).tokens)

    def prefix_tokens(self, params: CachePrepareParams) -> list[int]:
        """The token ids of the cacheable prefix of ``params`` (what an entry for them
        holds; [] when nothing is cacheable). Prefill exactly these to ``import_cache``."""
        self._ctx.check_open()
        plan = self.format.plan(self._ctx.normalize(params))
        return list(plan.prefix.tokens) if plan is not None else []

    def restore(self, target: CachePrepareParams | CacheHandle) -> Restored:
        """The cache of a handle (params are prepared first) in the framework's own type,
        an independent copy covering ``Restored.tokens``: pass it to the framework's
        generate with input ids that start with those tokens and have at least one more
        (``prompt_tokens`` gives them). An empty handle restores an empty cache."""
        self._ctx.check_open()
        clone = getattr(self.format, "clone", None)
        new = getattr(self.format, "new_cache", None)
        if clone is None or new is None:
            raise ConfigError(f"restore() is not supported by the {self.format.label} "
                              "controller", fix="use generate()")
        handle = self._ctx.prepare(target) if isinstance(target, CachePrepareParams) \
            else target
        if not isinstance(handle, CacheHandle):
            raise ConfigError(f"restore() takes params or a handle, not {type(handle).__name__}",
                              fix="pass the handle prepare() returned")
        query = self._ctx.known(handle)
        if handle.ref is None:
            loaded = None
        elif query is None:
            raise ConfigError("this handle was not prepared by this controller",
                              fix="prepare() the params with this controller first")
        else:
            loaded = self._ctx.loaded(handle, query)[0] \
                if self._state_of(handle, query) else None
        if loaded is None:
            return Restored(cache=new(), tokens=[], handle=handle)
        return Restored(cache=clone(loaded.cache), tokens=list(loaded.prefix.tokens),
                        handle=handle)

    def import_cache(self, params: CachePrepareParams, cache: Any, *,
                     check: str = "full") -> CacheHandle:
        """Store ``cache`` -- the framework's own cache object, covering exactly
        ``prefix_tokens(params)`` -- as the entry of ``params`` (``source="import"``).

        Checked before anything is written: the cache type, layer count, shapes and
        dtype, its length, and its K/V against the tokens recomputed by this model
        (a cache of other tokens, another template or another model is refused with a
        ConfigError). ``check="full"`` (default) recomputes every position -- one prefill
        -- so a token changed anywhere is caught; ``check="sample"`` recomputes four
        positions only (cheap; the caller vouches for the rest). The cache object is
        copied; the caller keeps theirs.
        """
        if check not in IMPORT_CHECKS:
            raise ConfigError(f"check must be one of {', '.join(IMPORT_CHECKS)}, not {check!r}",
                              fix='leave it out (check="full"), or pass check="sample" to '
                                  "recompute four positions only")
        self._ctx.check_writable("import caches")
        params = self._ctx.normalize(params)
        adopt = getattr(self.format, "adopt", None)
        if adopt is None:
            raise ConfigError(f"import_cache() is not supported by the {self.format.label} "
                              "controller", fix="use prepare()")
        plan = self.format.plan(params)
        if plan is None:
            raise ConfigError("these params have no cacheable prefix to import",
                              fix="mark fewer elements volatile")
        return self._ctx.store_imported(params, plan, adopt(cache, plan, full=check == "full"))
