"""spoolctl as a secondary tier under vLLM's CPU offloading (``OffloadingConnector``).

Add it behind vLLM's CPU tier::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
       "cpu_bytes_to_use": 8589934592,
       "secondary_tiers": [{"type": "SpoolTier", "module_path": "spoolctl.connector.tier",
                            "root": "/var/cache/spoolctl", "max_size": "500GiB"}]}}

Chunks cascade from the CPU tier into a spoolctl store (verified reads, manifest-last
commits, bounded capacity) and are promoted back after a restart. ``SpoolTier`` is resolved
lazily so that importing this package's pure helpers never imports vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SpoolTier"]


def __getattr__(name: str) -> Any:
    if name == "SpoolTier":
        from .manager import SpoolTier

        return SpoolTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
