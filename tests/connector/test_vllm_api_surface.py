"""The installed vLLM offers exactly the connector API spoolctl was written against.

Fails when vLLM's ``KVConnectorBase_V1`` / ``SupportsHMA`` signatures differ from the ones
the connector implements (``contract``), when the connector overrides a base method the
contract does not check, or when any other vLLM API the connector uses (``api_surface``)
is missing from the installed source. The same source check ran against vLLM 0.33.0's
source distribution (docs/connector.md, "Supported vLLM versions").
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from spoolctl.connector.vllm_api.api_surface import NEEDS, Need, check_tree
from spoolctl.connector.vllm_api.contract import (
    EXPECTED,
    HMA_EXPECTED,
    OPTIONAL_EXPECTED,
    check_contract,
    signature_drift,
)
from spoolctl.errors import ConfigError

VLLM_DIR = Path(importlib.util.find_spec("vllm").origin).parent
BASE = "distributed/kv_transfer/kv_connector/v1/base.py"


def test_installed_base_class_signatures_are_the_ones_the_connector_implements():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        SupportsHMA,
    )

    assert signature_drift(KVConnectorBase_V1, EXPECTED, OPTIONAL_EXPECTED) == []
    assert signature_drift(SupportsHMA, HMA_EXPECTED) == []


def test_every_base_method_the_connector_overrides_is_checked():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        SupportsHMA,
    )

    from spoolctl.connector import SpoolConnector

    checked = set(EXPECTED) | set(OPTIONAL_EXPECTED) | set(HMA_EXPECTED)
    overridden = {name for cls in SpoolConnector.__mro__
                  if cls.__module__.startswith("spoolctl.")
                  for name, value in vars(cls).items()
                  if callable(value) or isinstance(value, (classmethod, staticmethod))
                  if not name.startswith("_") or name == "__init__"
                  if hasattr(KVConnectorBase_V1, name) or hasattr(SupportsHMA, name)}
    assert "get_num_new_matched_tokens" in overridden  # the scan sees the connector
    assert overridden - checked == set()


def test_installed_vllm_has_every_api_the_connector_uses():
    report = check_tree(VLLM_DIR)
    assert report["problems"] == []
    assert report["new_hooks"] == []  # a new base hook must be reviewed before support


def _tree_with(tmp_path: Path, edit) -> Path:
    """A copy of the installed vLLM files the checks read, with ``edit(base_py_text)``."""
    root = tmp_path / "vllm"
    for rel in {n.module for n in NEEDS} | {BASE}:
        src = VLLM_DIR / rel
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    base = root / BASE
    base.write_text(edit(base.read_text()))
    return root


def test_source_check_names_a_changed_signature_a_gone_method_and_a_new_hook(tmp_path):
    def edit(text: str) -> str:
        text = text.replace("def get_num_new_matched_tokens(\n        self,\n        request",
                            "def get_num_new_matched_tokens(\n        self,\n        req", 1)
        text = text.replace("def update_connector_output(", "def _renamed_output(", 1)
        return text.replace("    def shutdown(self):",
                            "    def brand_new_hook(self):\n        return None\n\n"
                            "    def shutdown(self):", 1)

    root = _tree_with(tmp_path, edit)
    assert check_tree(VLLM_DIR)["problems"] == []  # the copy differs only by the edit
    report = check_tree(root)
    text = "; ".join(report["problems"])
    assert "get_num_new_matched_tokens(req, num_computed_tokens)" in text
    assert "update_connector_output is gone" in text
    assert report["new_hooks"] == ["brand_new_hook"]


def test_source_check_names_a_missing_attribute_or_module(tmp_path):
    root = _tree_with(tmp_path, lambda text: text)
    report = check_tree(root, needs=[
        Need("v1/request.py", "Request", ("request_id", "no_such_field")),
        Need("v1/not_there.py", "Anything"),
        Need(BASE, "KVConnectorBase_V1.register_kv_caches", params=("caches",)),
    ])
    assert report["problems"] == [
        "v1/request.py:Request.no_such_field is missing",
        "v1/not_there.py is missing",
        f"{BASE}:KVConnectorBase_V1.register_kv_caches(kv_caches) != expected (caches)",
    ]


def test_startup_refuses_a_drifted_base_with_every_difference():
    class Drifted:
        def __init__(self, vllm_config, role):  # kv_cache_config gone
            pass

        def get_num_new_matched_tokens(self, request, num_tokens):
            pass

        def unregister_kv_caches(self, level):  # optional hook, present and changed
            pass

    with pytest.raises(ConfigError) as err:
        check_contract(Drifted, "9.9.9")
    msg = err.value.message
    assert "9.9.9" in msg and "__init__(vllm_config, role)" in msg
    assert "get_num_new_matched_tokens(request, num_tokens)" in msg
    assert "unregister_kv_caches(level)" in msg and "restore_kv_caches" not in msg
