#!/usr/bin/env bash
# Examples job: execute or check every file in examples/ (tests/project/test_examples.py).
#
#   bash scripts/check_examples.sh            # everything, incl. vLLM twice (~2-4 min on 2 cores)
#   bash scripts/check_examples.sh -m 'not slow'   # skip the vLLM restart example
#
# Python examples run against locally generated tiny models / the local GenAI fake;
# Prometheus files go through `promtool check` when promtool is installed (Debian:
# apt-get install prometheus) and through a structural check of every metric name always;
# systemd units through `systemd-analyze verify` where available; cron lines and every
# `spoolctl ...` command line in units, cron and shell examples are parsed by the real CLI.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPOOLCTL_VENV:-.venv}"
for tool in promtool systemd-analyze; do
  if command -v "$tool" >/dev/null 2>&1; then
    echo "check_examples: using $tool" >&2
  else
    echo "check_examples: $tool not found; its check is skipped (structural checks still run)" >&2
  fi
done
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/project/test_examples.py "$@"
