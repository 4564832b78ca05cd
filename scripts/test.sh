#!/usr/bin/env bash
# The test command: set up .venv if needed, then lint, type-check and run the tests.
# Extra arguments go to pytest (e.g. `scripts/test.sh -m "not slow"`).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
ruff check .
ruff format --check .
mypy rlfw kernels
pytest "$@"
