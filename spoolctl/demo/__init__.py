"""The ``spoolctl demo`` job and the tiny random-weight models it and the tests build
(``tinymodel``, ``tinyfamilies``, ``tinyvlm``: no network, no downloaded weights)."""

from __future__ import annotations

from .run import DemoReport, DemoRow, demo_prompts, run_demo

__all__ = ["DemoReport", "DemoRow", "demo_prompts", "run_demo"]
