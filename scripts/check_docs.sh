#!/usr/bin/env bash
# Docs job: the CLI reference is current and the site builds with `mkdocs build --strict`.
#
#   bash scripts/check_docs.sh          # uses ./.venv (or $SPOOLCTL_VENV); installs the docs extra
#
# Needs the base install (scripts/run.sh demo|test builds it). Installs mkdocs and
# mkdocs-material from scripts/constraints.txt on first use. Takes ~10 s once installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPOOLCTL_VENV:-.venv}"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "check_docs: $PY not found; run 'bash scripts/run.sh demo' first" >&2
  exit 2
fi
if ! "$PY" -c "import mkdocs, material" 2>/dev/null; then
  "$PY" -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt \
    'mkdocs>=1.6' 'mkdocs-material>=9.5'
fi
"$PY" scripts/gen_cli_docs.py --check
NO_MKDOCS_2_WARNING=1 "$PY" -m mkdocs build --strict --quiet --site-dir "${SITE_DIR:-site}"
echo "check_docs: CLI reference current, mkdocs build --strict ok"
