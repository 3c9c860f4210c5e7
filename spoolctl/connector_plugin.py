"""vLLM general plugin: registers ``SpoolConnector`` by name with vLLM's connector factory.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes (API
server, engine core, workers) before it builds a connector, so with spoolctl installed
in vLLM's environment ``{"kv_connector": "SpoolConnector"}`` works without
``kv_connector_module_path``. Registration is lazy (module path + class name): nothing
here imports the connector, torch or the store until vLLM asks for the class.

``register()`` is idempotent (vLLM may call plugins more than once per process) and never
raises into vLLM's start-up: an incompatible vLLM only loses the short name, and the
explicit ``kv_connector_module_path="spoolctl.connector"`` keeps working.
"""

from __future__ import annotations

import logging

CONNECTOR_NAME = "SpoolConnector"
MODULE_PATH = "spoolctl.connector"

log = logging.getLogger(__name__)


def register() -> bool:
    """Register the connector name; True if it is (now or already) registered."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError as exc:  # vLLM too old/new for the factory API: keep the module path
        log.warning("spoolctl: cannot register %s with vLLM (%s); use "
                    "kv_connector_module_path=%r", CONNECTOR_NAME, exc, MODULE_PATH)
        return False
    registry = getattr(KVConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and CONNECTOR_NAME in registry:
        return True
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE_PATH, CONNECTOR_NAME)
    except ValueError:  # registered concurrently or by an earlier load: same outcome
        return True
    return True
