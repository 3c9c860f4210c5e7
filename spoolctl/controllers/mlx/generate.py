"""Generating with mlx-lm from a prepared cache: ``MlxBackend.generate``.

Only the uncached tokens are fed to mlx-lm (``generate_step``); when the cache covers the
whole prompt (mlx-lm rejects an empty prompt) the last cached token is trimmed and
re-fed, which yields exactly the cold logits. Greedy by default; a ``Decoding`` with a
temperature samples through ``make_sampler``, or with a seed through a sampler drawing from
a random key of its own. Imports ``mlx_lm`` lazily, when called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spoolctl.errors import ConfigError

from ..local.decoding import DEFAULT, Decoding, Sampling
from .runtime import MlxRuntime


def generate(backend: MlxRuntime, cache: Sequence[Any] | None, cached_tokens: int,
             prompt_tokens: Sequence[int], max_new_tokens: int,
             decoding: Decoding = DEFAULT) -> list[int]:
    """Continuation of ``prompt_tokens`` (stops at EOS or ``max_new_tokens``).

    ``cache`` (not modified) covers ``prompt_tokens[:cached_tokens]``; only the
    rest is fed to mlx-lm. If that rest is empty, the last cached token is
    trimmed and re-fed, since mlx-lm needs a non-empty prompt for the logits.
    ``decoding`` over mlx-lm's defaults (greedy): greedy, or ``make_sampler(temp, top_p,
    top_k)``; its streamer gets
    the prompt ids, every new token and ``end()``, as transformers feeds one.
    """
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    mx = backend.mx
    decoding = decoding.over(0.0)
    if max_new_tokens <= 0:
        return []
    if not prompt_tokens:
        raise ValueError("cannot generate from an empty prompt")
    if cache is None or cached_tokens <= 0:
        work, start = backend.new_cache(), 0
    else:
        if cached_tokens > min(backend.size(cache), len(prompt_tokens)):
            raise ValueError(f"cache covers {backend.size(cache)} tokens, asked to reuse "
                             f"{cached_tokens} of a {len(prompt_tokens)}-token prompt")
        start = min(cached_tokens, len(prompt_tokens) - 1)
        work = backend.trim(cache, start)
    kwargs: dict[str, Any] = dict(decoding.extra)
    if backend.kv_bits is not None:
        # The prompt through prefill (it converts at exactly quantized_kv_start), the last
        # token and the new ones one at a time through generate_step, whose own
        # conversion then also lands on that exact token.
        work = backend.prefill(work, prompt_tokens[start:-1])
        start = len(prompt_tokens) - 1
        kwargs.update(kv_bits=backend.kv_bits, kv_group_size=backend.kv_group_size,
                      quantized_kv_start=backend.quantized_kv_start)
    if not decoding.greedy:
        sampling = decoding.sampling()
        kwargs["sampler"] = _seeded_sampler(backend, sampling, sampling.seed) \
            if sampling.seed is not None else \
            make_sampler(temp=sampling.temperature,
                         top_p=sampling.top_p if sampling.top_p < 1 else 0.0,
                         top_k=sampling.top_k)
    streamer = decoding.streamer
    out: list[int] = []
    with backend.lock:
        if streamer is not None:
            import numpy as np

            streamer.put(np.array([list(prompt_tokens)]))
        try:
            steps = generate_step(mx.array(list(prompt_tokens[start:])), backend.model,
                                  prompt_cache=work, max_tokens=max_new_tokens,
                                  prefill_step_size=backend.prefill_step, **kwargs)
            for token, _ in steps:
                out.append(int(token))
                if streamer is not None:
                    streamer.put(np.array([int(token)]))
                if int(token) in backend.eos_ids:
                    break
        except TypeError as exc:
            if decoding.extra:
                raise ConfigError(f"mlx-lm refused generate_kwargs: {str(exc)[:200]}",
                                  fix="pass only generate_step() keyword arguments") \
                    from None
            raise
        finally:
            if streamer is not None:
                streamer.end()
    return out


def _seeded_sampler(backend: MlxRuntime, sampling: Sampling, seed: int) -> Any:
    """``make_sampler``'s top-p / top-k filters and categorical draw, from a random key
    of this call's own (``mx.random.seed`` would reseed the process-wide generator
    other threads and models draw from)."""
    from mlx_lm.sample_utils import apply_top_k, apply_top_p

    mx = backend.mx
    key = mx.random.key(seed)
    inv_temp = 1.0 / sampling.temperature

    def sampler(logprobs: Any) -> Any:
        nonlocal key
        key, draw = mx.random.split(key)
        if sampling.top_p < 1:
            logprobs = apply_top_p(logprobs, sampling.top_p)
        if sampling.top_k > 0:
            logprobs = apply_top_k(logprobs, sampling.top_k)
        return mx.random.categorical(logprobs * inv_temp, key=draw)

    return sampler
