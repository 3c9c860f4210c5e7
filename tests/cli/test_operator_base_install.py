"""Issue 15.2: a base install (``pip install spoolctl``, no extras) answers every usage
error with one line and exit 2, never a traceback.

The CLI used to import ``click`` to recognise usage errors; typer vendors its own copy and
a base install has no ``click`` package (the full test venv gets one through the docs
tools, so CI never saw it). Here ``click`` is made unimportable in the CLI's process, so
the class is caught in any environment; ``bash scripts/run.sh test-base`` also runs the
store and CLI test modules in a venv with only the declared dependencies (where the last
test checks that the venv really is that)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

NO_CLICK = ("import sys; sys.modules['click'] = None\n"
            "from spoolctl.cli.app import main\n"
            "main(sys.argv[1:])\n")


@pytest.mark.parametrize("argv", [
    ["--no-such-option"], ["no-such-command"], ["inspect"], ["ls", "--sort", "sideways"],
    ["status", "--rank", "many"], ["quarantine", "restore"], ["clean", "--min-age"],
    ["metrics", "--textfile"],
])
def test_usage_errors_need_no_click(argv: list[str], tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-c", NO_CLICK, *argv], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path,
                          env={k: v for k, v in os.environ.items()
                               if not k.startswith("SPOOLCTL_")})
    assert proc.returncode == 2, (argv, proc.stderr)
    assert "Traceback" not in proc.stderr and "unexpected" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr


def test_help_and_version_need_no_click(tmp_path) -> None:
    for argv in (["--help"], ["--version"], ["clean", "--help"]):
        proc = subprocess.run([sys.executable, "-c", NO_CLICK, *argv], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 0 and proc.stdout, (argv, proc.stderr)


NO_TORCH = ("import sys; sys.modules['torch'] = sys.modules['transformers'] = None\n"
            "from spoolctl.cli.app import main\n"
            "main(sys.argv[1:])\n")


def test_a_command_that_needs_an_extra_names_it(tmp_path) -> None:
    """Issue 36.1: `spoolctl demo` on a base install said "unexpected ModuleNotFoundError
    ... report it"; it names the extra to install, in one line, exit 2."""
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, "demo", "--preset", "tiny",
                           "--root", str(tmp_path / "store")], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("error: `spoolctl demo` needs the torch extra (torch is not "
                                   "installed): pip install 'spoolctl[torch]'"), proc.stderr


def test_each_framework_maps_to_its_extra() -> None:
    from spoolctl.cli.extras import missing_extra

    def gone(name: str) -> ModuleNotFoundError:
        return ModuleNotFoundError(f"No module named {name!r}", name=name)

    assert "pip install 'spoolctl[mlx]'" in missing_extra(gone("mlx_lm.models"), "spoolctl x")
    assert "pip install 'spoolctl[genai]'" in missing_extra(gone("google.genai"), "spoolctl x")
    assert "vLLM's own environment" in missing_extra(gone("vllm"), "spoolctl x")
    assert missing_extra(gone("yaml"), "spoolctl x") is None  # not ours: still a bug report
    assert missing_extra(ValueError("x"), "spoolctl x") is None


@pytest.mark.skipif(os.environ.get("SPOOLCTL_TEST_BASE_ONLY") != "1",
                    reason="only in the base-install venv (bash scripts/run.sh test-base)")
def test_the_base_venv_has_only_the_declared_dependencies() -> None:
    for name in ("click", "torch", "vllm", "mlx", "transformers", "google.genai", "mkdocs",
                 "numpy", "yaml"):
        assert importlib.util.find_spec(name.split(".")[0]) is None, name
