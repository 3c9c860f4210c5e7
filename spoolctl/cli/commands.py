"""Every spoolctl command, registered in one place.

Each command module defines its commands on its own ``commands`` Typer and imports nothing
of ``app``; ``register`` adds them to the spoolctl app in the order ``--help`` lists them
(the order an operator meets them: set up, look, verify, clean, repair, then the framework
and transfer commands). ``app`` imports this module; nothing here imports ``app``, so the
CLI has no import circle.
"""

from __future__ import annotations

import typer

from . import (
    clean_cmds,
    entry_cmds,
    health_cmds,
    keys_cmds,
    prefill,
    quarantine_cmds,
    scrub_cmds,
    store_cmds,
    transfer_cmds,
    vllm_config,
)

MODULES = (store_cmds, entry_cmds, clean_cmds, health_cmds, scrub_cmds, quarantine_cmds,
           keys_cmds, prefill, transfer_cmds, vllm_config)


def register(app: typer.Typer) -> None:
    """Add every module's commands to ``app`` (once per app)."""
    for module in MODULES:
        app.add_typer(module.commands)
