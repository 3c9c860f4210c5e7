"""Commands registered on the spoolctl app (being written)."""

from .app import app  # noqa: F401
