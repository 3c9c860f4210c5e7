"""The ``spoolctl`` operator CLI (typer + rich). Thin: parse, call the store or a
controller, render. No store logic lives here."""
