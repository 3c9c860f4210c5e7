"""The connector's wire messages as vLLM's metadata types.

``planning.messages`` holds them as plain dataclasses with no vLLM import; importing this
module registers each as a virtual subclass of the vLLM base it stands for, so vLLM's
``isinstance`` checks accept them. ``registered`` gives one the vLLM type for the checker.
"""

from __future__ import annotations

from typing import overload

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from ..planning.messages import SpoolConnectorMetadata, SpoolHandshake, SpoolWorkerMeta

KVConnectorMetadata.register(SpoolConnectorMetadata)
KVConnectorHandshakeMetadata.register(SpoolHandshake)
KVConnectorWorkerMetadata.register(SpoolWorkerMeta)


@overload
def registered(msg: SpoolConnectorMetadata) -> KVConnectorMetadata: ...
@overload
def registered(msg: SpoolHandshake) -> KVConnectorHandshakeMetadata: ...
@overload
def registered(msg: SpoolWorkerMeta) -> KVConnectorWorkerMetadata: ...
def registered(msg: object) -> object:
    """``msg`` itself, typed as the vLLM base it is registered under."""
    return msg
