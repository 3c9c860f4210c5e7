"""``spoolctl config vllm``: print the ``--kv-transfer-config`` JSON for the connector."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from spoolctl.store import ConfigError, parse_size

from .common import RootOption, err_console, resolve_root

if TYPE_CHECKING:
    pass

# This module's commands: cli/commands.py adds them to the spoolctl app (the one place
# that lists every command).
commands = typer.Typer()

SHUTDOWN_NOTE = (
    "note: also pass --shutdown-timeout 30 to vLLM (e.g. vllm serve MODEL "
    "--shutdown-timeout 30 --kv-transfer-config ...): with its default 0 a SIGTERM kills the "
    "engine without a drain and the chunks not yet committed are lost")

config_app = typer.Typer(name="config", help="Print configuration for serving engines.",
                         no_args_is_help=True, rich_markup_mode="rich")
commands.add_typer(config_app, name="config")


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
    model: Annotated[str | None, typer.Option(
        "--model", metavar="<dir|name>", help="The model directory vLLM will serve: checks "
        "the max size holds one 256-token chunk of it (not part of the output).")] = None,
    tp: Annotated[int, typer.Option(
        "--tp", min=1, help="Its tensor-parallel size (the chunk per rank shrinks with it).")]
        = 1,
) -> None:
    """Print the --kv-transfer-config JSON that starts vLLM with the spoolctl connector.

    `--max-size` is required: without it every rank store would be unbounded.

    Checks, before vLLM loads a model: the root is absolute and not a symlink, and you can
    create stores under it (run this as the user that runs vLLM); the max size is a size.
    A root on tmpfs is accepted with a warning on stderr (the cache would live in RAM). With
    --model (a local directory with config.json), the max size must hold one chunk of it.
    The connector repeats these checks at start-up.

    Start vLLM with --shutdown-timeout too (the JSON cannot carry it): with vLLM's default
    (0) a SIGTERM kills the engine without a drain and the chunks still queued for the
    store are lost. A note on stderr says so; stdout is the JSON alone.

    Example: [bold]vllm serve MODEL --shutdown-timeout 30 --kv-transfer-config "$(spoolctl
    config vllm --root /nvme/spool --max-size 200GiB)"[/bold]
    """
    from rich.text import Text

    from spoolctl.connector.deployment.preflight import (
        check_max_size,
        check_root,
        chunk_bytes_from_model_dir,
    )
    from spoolctl.store import check_root_path

    path = check_root_path(resolve_root(root))  # absolute, no symlink: fail here, not in vLLM
    if max_size is None:  # a store is bounded; its size is the operator's choice
        raise ConfigError("config vllm needs --max-size: without it every rank store of "
                          "the connector is unbounded",
                          fix="add --max-size SIZE (per rank store, e.g. 200GiB)")
    max_bytes = parse_size(max_size)
    if model is not None:  # a hub id or an unknown architecture: the connector checks
        check_max_size(max_bytes, chunk_bytes_from_model_dir(model, tp=tp), 256)
    for line in check_root(path):  # unwritable: ConfigError (exit 2); tmpfs: a warning
        typer.echo(f"warning: {line}", err=True)
    typer.echo(json.dumps(kv_transfer_config(str(path), max_size), separators=(",", ":")))
    # stderr: `--kv-transfer-config "$(spoolctl config vllm)"` takes stdout only, and a
    # person running it sees the note beside the JSON.
    err_console.print(Text(SHUTDOWN_NOTE), soft_wrap=True)
