"""Decoding settings of a local ``generate`` call: sampling, a streamer, framework kwargs.

Pure data and validation (no framework imports). The backends map a ``Decoding`` to
their framework:

* PyTorch: ``model.generate(generation_config=..., streamer=..., **extra)`` -- the model's
  own ``generation_config`` (its ``do_sample``, temperature, top-p / top-k, repetition
  penalty...) with the caller's settings over it; ``temperature > 0`` samples
  (``do_sample=True``) with ``top_p`` / ``top_k``.
* mlx-lm: ``generate_step(sampler=make_sampler(temp, top_p, top_k=...), **extra)``; the
  streamer is fed like transformers feeds it (the prompt ids first, then every new
  token, then ``end()``), so a ``transformers.TextStreamer`` works with both. mlx-lm's
  defaults are greedy decoding (its ``generate`` ignores ``generation_config.json``'s
  sampling), so are the backend's.

A setting left out (None) is the framework's default for the model (``over``), so a call
with no settings decodes as the framework's own generate with no arguments would;
``temperature == 0`` is greedy decoding; ``seed`` seeds a random generator
of the call's own (a ``torch.Generator`` / an ``mx.random.key``), never the framework's
global one, so concurrent seeded calls give what serial ones give.
``extra`` is handed to the framework's own generate call verbatim (e.g.
``repetition_penalty`` for transformers, ``logits_processors`` for mlx-lm); the
arguments spoolctl sets itself (prompt, cache, length, sampling, streamer) are refused
there, so a setting is never silently overridden.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spoolctl.errors import ConfigError

#: Arguments the backends set themselves; ``generate_kwargs`` may not name them.
RESERVED = frozenset({
    "input_ids", "inputs", "attention_mask", "past_key_values", "cache", "prompt_cache",
    "prompt", "model", "max_new_tokens", "max_tokens", "max_length", "generation_config",
    "streamer", "do_sample", "temperature", "top_p", "top_k", "sampler",
})


@dataclass(frozen=True)
class Decoding:
    """How to pick the next tokens (see the module docstring)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    streamer: Any = field(default=None, compare=False)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        t = self.temperature
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not math.isfinite(t) or t < 0):
            raise ConfigError(f"temperature must be a number >= 0, not {t!r}",
                              fix="pass 0 for greedy decoding or e.g. 0.7 to sample")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))
                              or not 0 < p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], not {p!r}", fix="pass e.g. 0.9")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ConfigError(f"top_k must be an integer >= 0, not {k!r}",
                              fix="pass 0 (off) or e.g. 50")
        if t == 0:
            self._refuse_filters()
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, int) or self.seed < 0):
            raise ConfigError(f"seed must be an integer >= 0, not {self.seed!r}",
                              fix="pass e.g. seed=0, or leave it out")
        if self.streamer is not None and not (callable(getattr(self.streamer, "put", None))
                                              and callable(getattr(self.streamer, "end", None))):
            raise ConfigError(f"streamer must have put() and end() (a transformers streamer), "
                              f"not {type(self.streamer).__name__}",
                              fix="pass e.g. transformers.TextStreamer(tokenizer)")
        if not isinstance(self.extra, Mapping) or not all(isinstance(k, str) for k in self.extra):
            raise ConfigError("generate_kwargs must be a dict of keyword arguments",
                              fix="pass e.g. generate_kwargs={'repetition_penalty': 1.1}")
        clash = sorted(RESERVED & set(self.extra))
        if clash:
            raise ConfigError(f"generate_kwargs may not set {clash}: spoolctl sets them",
                              fix="use generate()'s own arguments (max_new_tokens, "
                                  "temperature, top_p, top_k, streamer)")
        object.__setattr__(self, "extra", dict(self.extra))

    def _refuse_filters(self) -> None:
        if (self.top_p is not None and self.top_p < 1) or (self.top_k or 0) > 0:
            raise ConfigError("top_p / top_k have no effect with greedy decoding "
                              "(temperature=0, or a model whose default is greedy)",
                              fix="pass a temperature > 0 to sample, or drop top_p / top_k")

    def over(self, temperature: float, top_p: float = 1.0, top_k: int = 0) -> Decoding:
        """These settings over a model's defaults (``temperature`` 0: the model decodes
        greedily by default): each setting left out takes the default. A greedy result
        drops the defaults' top-p / top-k and refuses the caller's."""
        t = float(self.temperature if self.temperature is not None else temperature)
        if t == 0:
            self._refuse_filters()
            return dataclasses.replace(self, temperature=0.0, top_p=1.0, top_k=0)
        return dataclasses.replace(
            self, temperature=t, top_p=float(self.top_p if self.top_p is not None else top_p),
            top_k=int(self.top_k if self.top_k is not None else top_k))

    def sampling(self) -> Sampling:
        """The sampling settings of a decoding resolved by ``over``; ValueError for one that
        is not (a setting still left to the model)."""
        t, p, k = self.temperature, self.top_p, self.top_k
        if t is None or p is None or k is None:
            raise ValueError("decoding settings are not resolved: call over() first")
        return Sampling(temperature=float(t), top_p=float(p), top_k=int(k), seed=self.seed)

    @property
    def greedy(self) -> bool:
        """Whether this (resolved, ``over``) decoding is greedy."""
        return self.temperature == 0

    @property
    def is_default(self) -> bool:
        """No setting at all (the model's defaults), no seed, streamer or extra kwargs: what
        every backend supports."""
        return self.temperature is None and self.top_p is None and self.top_k is None \
            and self.seed is None and self.streamer is None and not self.extra


@dataclass(frozen=True)
class Sampling:
    """The settings of a resolved decoding (``Decoding.sampling``), none left out."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None


#: The model's own defaults (what the framework's generate does with no arguments).
DEFAULT = Decoding()
#: Greedy decoding, whatever the model's defaults.
GREEDY = Decoding(temperature=0.0)
