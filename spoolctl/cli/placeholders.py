"""What ``--help`` shows after an option: the same placeholder for the same thing everywhere.

typer shows a ``<bool>`` placeholder after boolean flags (``--json <bool>``), yet a flag takes
no value (``--json true`` fails), and it names a plain string option by its Python type
(``--kind <str>`` in one command, ``--kind <kind>`` in another). ``polish`` walks the click
command tree once per run and fixes both; tests/test_cli_contract.py checks that no
``<bool>``/``<str>`` is left and that an option name has one placeholder across commands.
"""

from __future__ import annotations

from typing import Any

# Options whose value is not plain text: the placeholder says what to write. Options with
# choices (``<size|age|access>``) or an explicit metavar keep theirs.
PLACEHOLDERS: dict[str, str] = {
    "--max-size": "<size>",
    "--store-max-size": "<size>",
    "--max-import-size": "<size>",
    "--rate": "<bytes/s>",  # scrub; prefill's --rate says <requests/s> itself
    "--min-age": "<duration>",
    "--older-than": "<duration>",
    "--unused-for": "<duration>",
    "--kind": "<kind>",
    "--deployment": "<deployment>",
    "--namespace": "<namespace>",
    "--backend": "<backend>",
    "--device": "<device>",
    "--dtype": "<dtype>",
    "--preset": "<preset>",
    "--prompt": "<text>",
    "--genai-endpoint": "<url>",
    "--rank": "<rank>",
    "--limit": "<n>",
    "--max-items": "<n>",
    "--concurrency": "<n>",
    "--retries": "<n>",
    "--timeout": "<seconds>",
    "--tenant": "<tenant>",
    "--sign-key": "<file>",
    "--verify-key": "<file>",
}


def polish(command: Any, ctx: Any = None) -> None:
    """Fix the placeholders of ``command`` and its subcommands in place (help option too)."""
    from typer._click import Context

    # The command's own context settings (the app's ``-h``/``--help`` names), as click makes
    # them when it runs: the help option is created once and cached on the command.
    ctx = Context(command, info_name=command.name, parent=ctx,
                  **(getattr(command, "context_settings", None) or {}))
    params = list(command.params)
    help_option = command.get_help_option(ctx)
    if help_option is not None:
        params.append(help_option)
    for param in params:
        if getattr(param, "param_type_name", "") != "option":
            continue
        if getattr(param, "is_flag", False) or getattr(param, "count", False):
            param.metavar = ""  # a flag takes no value: no placeholder
            continue
        if param.metavar is None:
            long = next((o for o in param.opts if o.startswith("--")), None)
            if long in PLACEHOLDERS:
                param.metavar = PLACEHOLDERS[long]
    for sub in getattr(command, "commands", {}).values():
        polish(sub, ctx)
