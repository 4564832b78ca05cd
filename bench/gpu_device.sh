#!/bin/bash
# The GPU checks on a bare CUDA machine with torch and triton but no rlfw install: run from the checkout,
# results under $OUT (default bench/gpu_out). About 3 minutes on an H200 with the default CONFIGS.
#   OUT=/tmp/gpu bash bench/gpu_device.sh
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/gpu_out}
mkdir -p "$OUT"
for pkg in kernels configs recipes; do [ -e "rlfw/$pkg" ] || ln -s "../$pkg" "rlfw/$pkg"; done  # the installed layout
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/smi.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/smi.txt" 2>&1
timeout "${T1:-260}" python3 bench/gpu_check.py --reps "${REPS:-15}" --out "$OUT/gpu_check.json" > "$OUT/gpu_check.log" 2>&1
echo "gpu_check rc=$?"
OUT=$OUT CONFIGS=${CONFIGS:-product,previous} PROFILES=${PROFILES:-13m:bf16,76m:bf16} STEPS_13M=1 \
  timeout "${T2:-300}" \
  python3 bench/gpu_matmul_tiles.py > "$OUT/tiles.log" 2>&1
echo "tiles rc=$?"
tail -3 "$OUT/gpu_check.log"; tail -12 "$OUT/tiles.log"
