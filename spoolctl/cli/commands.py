"""Registers the operator commands on the spoolctl app.

One module per group of commands; they are imported in this order so ``--help``
lists them in the order an operator meets them (set up, look, verify, clean, repair).
"""

import importlib

from .app import app  # noqa: F401

for _module in ("store_cmds", "entry_cmds", "clean_cmds", "health_cmds", "scrub_cmds",
                "quarantine_cmds", "keys_cmds"):
    importlib.import_module(f"{__package__}.{_module}")
