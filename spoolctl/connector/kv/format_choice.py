"""Which stored chunk format a deployment uses: the one place that knows both formats."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .format_grouped import GroupedFormat
from .format_single import SingleFormat

if TYPE_CHECKING:
    from ..vllm_api.introspect import Deployment
    from .formats import KVFormat


def format_for(deployment: Deployment) -> KVFormat:
    """The format of ``deployment`` (grouped when it has per-group layouts)."""
    if deployment.layouts:
        return GroupedFormat(deployment.chunk_tokens, deployment.groups, deployment.layouts)
    return SingleFormat(deployment.chunk_tokens, deployment.block_size)
