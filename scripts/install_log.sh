# Sourced by scripts/run.sh: installs write to a log file, not to the terminal, so the first
# screen a new user sees is the job's own output (pip and setuptools print warnings nobody
# can act on, e.g. setuptools' editable-install notice). A failed step shows the log's tail.

# logged LOG CMD...: run CMD with its stdout and stderr appended to LOG; on failure print
# what failed and the last 40 lines of LOG to stderr, and return CMD's status.
logged() {
  local log="$1"; shift
  local rc=0
  "$@" >>"$log" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then
    echo "run.sh: '$*' failed (exit $rc); the last lines of $log:" >&2
    tail -n 40 "$log" >&2
  fi
  return "$rc"
}
