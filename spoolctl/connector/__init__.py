"""The vLLM connector: persistent prompt-prefix KV across engine restarts.

Load it in vLLM with::

    --kv-transfer-config '{"kv_connector": "SpoolConnector",
                           "kv_connector_module_path": "spoolctl.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"spoolctl_root": "/nvme/spool",
                                                         "spoolctl_max_size": "200GiB"}}'

``SpoolConnector`` is resolved lazily (module ``__getattr__``) so that importing
``spoolctl.connector`` or its pure helpers (chain keys, identity, planning) never
imports vLLM or torch; only touching ``SpoolConnector`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .connector import SpoolConnector

__all__ = ["SpoolConnector"]


def __getattr__(name: str) -> type[SpoolConnector]:
    if name == "SpoolConnector":
        from .connector import SpoolConnector

        return SpoolConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
