"""``spoolctl config vllm``: print the ``--kv-transfer-config`` JSON for the connector."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from spoolctl.store import ConfigError, parse_size
from spoolctl.store.root import check_root_path

from .app import app
from .common import RootOption, resolve_root

config_app = typer.Typer(name="config", help="Print configuration for serving engines.",
                         no_args_is_help=True, rich_markup_mode="rich")
app.add_typer(config_app, name="config")


def kv_transfer_config(root: str, max_size: str | None) -> dict[str, Any]:
    """The vLLM ``KVTransferConfig`` document that loads the spoolctl connector (pure)."""
    extra: dict[str, Any] = {"spoolctl_root": root}
    if max_size is not None:
        extra["spoolctl_max_size"] = max_size
    return {
        "kv_connector": "SpoolConnector",
        "kv_connector_module_path": "spoolctl.connector",
        "kv_role": "kv_both",
        # A chunk that fails verification at restore is reported as a load error; with
        # "recompute" vLLM recomputes it (vLLM's default "fail" would fail the request).
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


@config_app.command("vllm")
def config_vllm(
    root: RootOption = None,
    max_size: Annotated[str | None, typer.Option(
        "--max-size", help="Max size of each rank store, e.g. 200GiB (required; checked "
        "here, passed as written).")] = None,
) -> None:
    """Print the --kv-transfer-config JSON that starts vLLM with the spoolctl connector.

    `--max-size` is required: without it every rank store would be unbounded.

    Example: [bold]vllm serve MODEL --kv-transfer-config "$(spoolctl config vllm --root
    /nvme/spool --max-size 200GiB)"[/bold]
    """
    path = check_root_path(resolve_root(root))  # absolute, no symlink: fail here, not in vLLM
    if max_size is None:  # a store is bounded; its size is the operator's choice (36.2)
        raise ConfigError("config vllm needs --max-size: without it every rank store of "
                          "the connector is unbounded",
                          fix="add --max-size SIZE (per rank store, e.g. 200GiB)")
    parse_size(max_size)
    typer.echo(json.dumps(kv_transfer_config(str(path), max_size), separators=(",", ":")))
