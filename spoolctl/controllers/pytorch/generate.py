"""Generating with transformers from a prepared cache: ``PyTorchBackend.generate``.

Decoding is transformers' own ``model.generate`` (sampling, streamers, logits processors)
continued from a clone of the cache; a seeded request draws from a generator of its own.
"""

from __future__ import annotations

import copy
from typing import Any

from spoolctl.errors import ConfigError

from ..local.decoding import DEFAULT, Decoding, Sampling
from .runtime import TorchRuntime


def resolve(backend: TorchRuntime, decoding: Decoding) -> Decoding:
    """``decoding`` over the model's ``generation_config``: what ``model.generate``
    would sample with where the caller left a setting out (transformers' global
    defaults where the config leaves one out too)."""
    config = backend.model.generation_config
    defaults_of = getattr(config, "_get_default_generation_params", None)
    defaults = defaults_of() if callable(defaults_of) else {}

    def value(name: str, fallback: float) -> Any:
        got = getattr(config, name, None)
        return got if got is not None else defaults.get(name, fallback)

    return decoding.over(float(value("temperature", 1.0)) if config.do_sample else 0.0,
                         top_p=float(value("top_p", 1.0)), top_k=int(value("top_k", 0)))


def _generation_config(backend: TorchRuntime, decoding: Decoding, max_new_tokens: int, *,
                       sample: bool = True) -> Any:
    """The model's generation config (its repetition penalty and every other setting
    ``model.generate`` would use) with spoolctl's length and the resolved sampling
    settings (sampling flags cleared for greedy decoding, so transformers has nothing to
    warn about). ``sample=False``: a seeded sampler in ``logits_processor`` draws the
    token, so transformers' own sampling stays off."""
    config = copy.deepcopy(backend.model.generation_config)
    config.max_new_tokens = max_new_tokens
    config.max_length = None
    config.min_new_tokens = None
    sampling = sample and not decoding.greedy
    config.do_sample = sampling
    config.temperature = decoding.temperature if sampling else None
    config.top_p = decoding.top_p if sampling else None
    config.top_k = decoding.top_k if sampling else None
    if config.pad_token_id is None:
        config.pad_token_id = backend.tokenizer.pad_token_id \
            if backend.tokenizer.pad_token_id is not None else min(backend.eos_ids, default=None)
    if backend.eos_ids:
        config.eos_token_id = sorted(backend.eos_ids)
    return config


def generate(backend: TorchRuntime, cache: Any | None, cached_tokens: int, prompt_tokens: list[int],
             max_new_tokens: int, decoding: Decoding = DEFAULT) -> list[int]:
    """``model.generate`` continued from ``cache`` (cloned, never modified): the
    uncached prompt tokens but the last are prefilled in chunks first, so a long
    prompt never runs as one forward. ``decoding`` over the model's own defaults
    (``resolve``)."""
    torch = backend.torch
    decoding = resolve(backend, decoding)
    if not 0 <= cached_tokens < len(prompt_tokens):
        raise ValueError("the cache must leave at least one prompt token to run")
    if cache is None:
        work, cached_tokens = backend.new_cache(), 0
    else:
        if backend.length(cache) != cached_tokens:
            raise ValueError("cache length differs from cached_tokens")
        work = backend.clone(cache)
    if len(prompt_tokens) - cached_tokens > 1:
        backend.forward(work, prompt_tokens[cached_tokens:-1])
    # generate() slices the prompt by the cache's length, except for ``cache_params``
    # (recurrent-only) models, which would run the whole prompt again on top of the
    # state: they get only the uncached last token.
    recurrent = backend.cache_arg == "cache_params" and len(prompt_tokens) > 1
    shown = prompt_tokens[-1:] if recurrent else prompt_tokens
    ids = torch.tensor([list(shown)], dtype=torch.long, device=backend.device)
    kwargs = {backend.cache_arg: work, **decoding.extra}
    seed = None if decoding.greedy else decoding.seed
    seeded = seed is not None
    if seed is not None:
        # A generator of this call's own: torch's global one is shared by every thread
        # (two seed=0 calls at once would interleave their draws).
        sampler = _seeded_sampler(backend, decoding.sampling(), seed)
        kwargs["logits_processor"] = [*(kwargs.get("logits_processor") or []), sampler]
    try:
        with torch.no_grad():
            out = backend.model.generate(
                ids, attention_mask=torch.ones_like(ids), streamer=decoding.streamer,
                generation_config=_generation_config(backend, decoding, max_new_tokens,
                                                          sample=not seeded),
                **kwargs)
    except (TypeError, ValueError) as exc:
        if decoding.extra:  # most likely the caller's kwargs: say so
            raise ConfigError(f"transformers refused generate_kwargs: {str(exc)[:200]}",
                              fix="pass only model.generate() keyword arguments") from None
        raise
    if not recurrent and backend.length(work) < len(prompt_tokens):
        raise RuntimeError("generate did not continue from the given KV cache")
    return out[0, len(shown):].tolist()


def _seeded_sampler(backend: TorchRuntime, sampling: Sampling, seed: int) -> Any:
    """A logits processor that samples like transformers (temperature, top-k, top-p
    warpers, then a multinomial draw) from a generator seeded for this call only, and
    leaves only the drawn token possible, so the (greedy) search picks it."""
    import transformers

    torch = backend.torch
    warpers: list[Any] = [transformers.TemperatureLogitsWarper(sampling.temperature)]
    if sampling.top_k:
        warpers.append(transformers.TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1:
        warpers.append(transformers.TopPLogitsWarper(sampling.top_p))
    generator = torch.Generator(device=backend.device)
    generator.manual_seed(seed)

    class SeededSampler(transformers.LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            for warp in warpers:
                scores = warp(input_ids, scores)
            probs = torch.softmax(scores.float(), dim=-1)
            drawn = torch.multinomial(probs, num_samples=1, generator=generator)
            only = torch.full_like(scores, float("-inf"))
            return only.scatter_(1, drawn, 0.0)

    return SeededSampler()
