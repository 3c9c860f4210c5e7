"""Issue 28.4 / decision 2530: the layer contracts cover the whole store.

``bash scripts/run.sh lint`` runs import-linter over ``.importlinter``; its *forbidden*
contract lists the store's inside by name. This test fails when a module or sub-package is
added to ``spoolctl/store`` without being named there, so no new module escapes the rule
that only ``spoolctl.store`` itself is imported from outside."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest
from testpaths import REPO_DIR

import spoolctl.store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

REPO = REPO_DIR
STORE = Path(spoolctl.store.__file__).parent


def _contract(name: str) -> dict[str, list[str]]:
    config = configparser.ConfigParser()
    config.read(REPO / ".importlinter")
    section = config[f"importlinter:contract:{name}"]
    return {k: [v.strip() for v in section[k].split("\n") if v.strip()] for k in section}


def test_the_forbidden_contract_names_everything_inside_the_store() -> None:
    inside = {f"spoolctl.store.{p.stem}" for p in STORE.glob("*.py") if p.stem != "__init__"}
    inside |= {f"spoolctl.store.{d.name}" for d in STORE.iterdir()
               if (d / "__init__.py").is_file()}
    assert set(_contract("store-public-api")["forbidden_modules"]) == inside


def test_every_top_level_module_has_a_layer() -> None:
    """A new top-level module or package must be placed in the layers (or it is unchecked)."""
    top = {f"spoolctl.{p.stem}" for p in STORE.parent.glob("*.py")
           if p.stem not in ("__init__", "__main__", "connector_plugin")}
    top |= {f"spoolctl.{d.name}" for d in STORE.parent.iterdir()
            if (d / "__init__.py").is_file()}
    layered = {m.strip() for layer in _contract("layers")["layers"]
               for m in layer.replace("|", " ").replace(":", " ").split()}
    assert top <= layered, f"not in a layer of .importlinter: {sorted(top - layered)}"
