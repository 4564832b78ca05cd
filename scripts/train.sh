#!/usr/bin/env bash
# The main job: set up .venv if needed, then `rlfw train` with any overrides (recipe=NAME, correction=tis, ...).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec rlfw train "$@"
