#!/usr/bin/env bash
# Serve a model with vLLM and the spoolctl connector (OpenAI-compatible server).
#
#   MODEL=/models/llama SPOOL_ROOT=/nvme/spool MAX_SIZE=200GiB bash examples/vllm_serve.sh
#
# spoolctl must be installed in vLLM's own environment (pip install spoolctl). With it,
# vLLM's plugin entry point registers the name "SpoolConnector"; the explicit
# kv_connector_module_path below also works on a vLLM that does not load plugins.
# One store per rank is automatic: each worker uses
# $SPOOL_ROOT/<deployment digest>/rank-<NNNN> (from vLLM's TP/PP config). Use the same
# local-disk SPOOL_ROOT on every host; `spoolctl status --root $SPOOL_ROOT/<digest>` shows all
# ranks of this host and flags ranks that disagree.
set -euo pipefail

MODEL="${MODEL:?set MODEL to a local model directory or a Hugging Face id}"
SPOOL_ROOT="${SPOOL_ROOT:-/var/cache/spoolctl/vllm}"
MAX_SIZE="${MAX_SIZE:-200GiB}"
TP="${TP:-1}"

# `spoolctl config vllm` checks the root and the size and prints the JSON document;
# kv_load_failure_policy=recompute makes a corrupt chunk a recompute, never a failed request.
KV_CONFIG=$(spoolctl config vllm --root "$SPOOL_ROOT" --max-size "$MAX_SIZE" | python3 -c '
import json, sys
doc = json.load(sys.stdin)
doc["kv_connector_extra_config"]["spoolctl_root"] = sys.argv[1]
doc["kv_load_failure_policy"] = "recompute"
print(json.dumps(doc))' "$SPOOL_ROOT")

echo "kv-transfer-config: $KV_CONFIG" >&2
exec vllm serve "$MODEL" \
  --tensor-parallel-size "$TP" \
  --kv-transfer-config "$KV_CONFIG" \
  "$@"

# Then, per request, opt out of the disk cache (nothing restored, nothing stored):
#   curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{
#     "model": "'"$MODEL"'", "prompt": "...", "max_tokens": 16,
#     "kv_transfer_params": {"spoolctl_bypass": true}}'
# Separate tenants' caches with a salt (different salt = never shared):
#     "cache_salt": "tenant-42"
# Metrics: curl -s localhost:8000/metrics | grep '^spoolctl_'
