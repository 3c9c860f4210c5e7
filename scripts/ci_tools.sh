#!/usr/bin/env bash
# The real tools some tests use, from Debian, so that on CI a skip means "not possible on this
# host", never "not installed" (issue 27.7). Run by .ci/run as root; elsewhere it says what it
# would install and leaves the machine alone.
#
#   promtool (Debian package prometheus): tests/project/test_examples.py checks the shipped alert rules
#   and recording rules with it; docs snippets that call it run too.
#   fuse3 (libfuse3 and fusermount3): tests/store/test_disk_faults.py fails reads with EIO on a real
#   FUSE filesystem (tests/fusefs.py, through mfusepy from the dev extra).
set -euo pipefail
need=()
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v fusermount3 >/dev/null 2>&1 || need+=(fuse3)
if [ "${#need[@]}" = 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "ci_tools: not installing ${need[*]} (needs root and apt-get); the tests that use them skip" >&2
  exit 0
fi
log="$(mktemp -t spoolctl-ci-tools.XXXXXX.log)"
# The package's service is not started: policy-rc.d refuses it in containers, and nothing here
# needs a running Prometheus, only promtool.
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
         --no-install-recommends "${need[@]}"; } >"$log" 2>&1; then
  echo "ci_tools: installing ${need[*]} failed; the last lines of $log:" >&2
  tail -n 30 "$log" >&2
  exit 1
fi
echo "ci_tools: installed ${need[*]}" >&2
