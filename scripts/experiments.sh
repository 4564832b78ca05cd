#!/usr/bin/env bash
# The experiments of docs/findings.md, each a sweep declared by a recipe in recipes/experiments/, then the
# comparison page of each sweep. `--quick` runs the quick variants (a smoke test, not a result).
#   scripts/experiments.sh [--quick] [ROOT]      (run folders under ROOT, default runs/experiments)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
suffix=""
if [ "${1:-}" = "--quick" ]; then suffix="_quick"; shift; fi
out="${1:-runs/experiments}"
status=0
for experiment in discrepancy_lag resync router_replay stale_kv; do
  rlfw train -m "recipe=experiments/${experiment}${suffix}" "logger.run_root=$out" || status=1
  rlfw report "$out/${experiment}${suffix}" || status=1
done
exit "$status"
