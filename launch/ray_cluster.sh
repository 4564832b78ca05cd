#!/usr/bin/env bash
# Start a Ray node for rlfw.
#   launch/ray_cluster.sh head            # on the head node
#   launch/ray_cluster.sh worker HEAD_IP  # on every other node
# Each node advertises its GPUs as both `GPU` and the pool resources rlfw's placement groups ask for.
set -euo pipefail
role="${1:?usage: ray_cluster.sh head | worker HEAD_IP}"
gpus="$(nvidia-smi -L 2>/dev/null | wc -l || echo 0)"
resources="{\"rollout_gpu\": ${gpus}, \"trainer_gpu\": ${gpus}}"
case "$role" in
  head) ray start --head --port=6379 --num-gpus="$gpus" --resources="$resources" ;;
  worker) ray start --address="${2:?HEAD_IP}:6379" --num-gpus="$gpus" --resources="$resources" ;;
  *) echo "unknown role $role; use head or worker" >&2; exit 2 ;;
esac
