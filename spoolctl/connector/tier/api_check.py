"""Whether the installed vLLM's tier API is the one ``SpoolTier`` implements (pure).

vLLM marks its secondary-tier API experimental: a release may add a required method or
change a hook's parameters. Python would then fail late (an abstract class, a TypeError on
the scheduler thread) or never call a renamed hook; ``check_tier_api`` refuses at start-up
instead, in one line naming the vLLM version.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

from spoolctl.errors import ConfigError

# The SecondaryTierManager methods SpoolTier implements (vLLM 0.32 and 0.33).
HOOKS = ("lookup", "submit_store", "submit_load", "get_finished_jobs", "has_pending_work",
         "take_events", "touch", "on_new_request", "on_request_finished", "on_schedule_end",
         "drain_jobs", "shutdown", "get_stats", "build_metric_definitions")


def _params(fn: object) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()  # type: ignore[arg-type]
            if p.kind is not inspect.Parameter.VAR_KEYWORD]


def api_differences(base: type, tier: type, hooks: Iterable[str] = HOOKS) -> list[str]:
    """How ``base`` (vLLM's ABC) differs from what ``tier`` implements; empty if it does not."""
    hooks = tuple(hooks)
    out = [f"new required method {name}()" for name in
           sorted(getattr(base, "__abstractmethods__", ())) if name not in hooks]
    for name in hooks:
        if not hasattr(base, name):
            out.append(f"no {name}() any more")
        elif _params(getattr(base, name)) != _params(getattr(tier, name)):
            out.append(f"{name}() takes ({', '.join(_params(getattr(base, name)))})")
    return out


def check_tier_api(base: type, tier: type, version: str, hooks: Iterable[str] = HOOKS) -> None:
    """ConfigError (one line, naming ``version``) if ``tier`` does not fit ``base``."""
    differences = api_differences(base, tier, hooks)
    if differences:
        raise ConfigError(f"SpoolTier does not support vLLM {version}'s secondary tier API: "
                          f"{'; '.join(differences)}",
                          fix="use a vLLM version SpoolTier supports (0.32, 0.33: "
                              "docs/connector.md), or SpoolConnector")
