"""Where the tests and the repository are, for test modules in any folder under tests/."""

from __future__ import annotations

from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent  # the support modules and drivers live here
REPO_DIR = TESTS_DIR.parent
