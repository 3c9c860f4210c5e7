"""Every spoolctl command, registered in one place.

Each command module defines its commands on its own ``commands`` Typer and imports nothing
of ``app``; ``register`` adds them to the spoolctl app in the order ``--help`` lists them
(the order an operator meets them: set up, look, verify, clean, repair, then the framework
and transfer commands). ``app`` imports this module; nothing here imports ``app``, so the
CLI has no import circle.

A process runs one command, so ``module_of`` imports only the module that defines it
(``COMMANDS``: each top-level command or group, by name); ``--help``, a typo and the
reference generator get every module (``modules``). ``tests/test_cli_wiring.py`` checks that
``COMMANDS`` names exactly what each module defines.
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

import typer

# In --help order.
MODULE_NAMES = ("store_cmds", "entry_cmds", "clean_cmds", "health_cmds", "scrub_cmds",
                "quarantine_cmds", "keys_cmds", "prefill", "transfer_cmds", "vllm_config")
COMMANDS = {
    "init": "store_cmds", "status": "store_cmds", "ls": "entry_cmds", "inspect": "entry_cmds",
    "clean": "clean_cmds", "metrics": "health_cmds", "doctor": "health_cmds",
    "scrub": "scrub_cmds", "request-auth": "scrub_cmds", "quarantine": "quarantine_cmds",
    "keys": "keys_cmds", "prefill": "prefill", "demo": "prefill", "export": "transfer_cmds",
    "import": "transfer_cmds", "config": "vllm_config",
}


def _load(name: str) -> ModuleType:
    return import_module(f"{__package__}.{name}")


def modules() -> tuple[ModuleType, ...]:
    """Every command module, in --help order (each imported now)."""
    return tuple(_load(name) for name in MODULE_NAMES)


def module_of(command: str) -> ModuleType | None:
    """The module defining top-level command or group ``command`` (imported now), or None."""
    name = COMMANDS.get(command)
    return _load(name) if name is not None else None


def register(app: typer.Typer) -> None:
    """Add every module's commands to ``app`` (once per app)."""
    for module in modules():
        app.add_typer(module.commands)
