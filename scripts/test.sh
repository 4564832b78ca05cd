#!/usr/bin/env bash
# The test command: set up .venv if needed, then lint, type-check and run the tests.
# Extra arguments go to pytest (e.g. `scripts/test.sh -m "not slow"`).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
# The comparison page's browser test needs headless Chromium from the system packages.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
fi
ruff check .
ruff format --check .
mypy rlfw kernels
pytest "$@"
