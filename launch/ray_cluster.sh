#!/usr/bin/env bash
# Start a Ray node for rlfw. Arguments after the role go to `ray start` as they are.
#   launch/ray_cluster.sh head [RAY_START_ARGS...]               # on the head node
#   launch/ray_cluster.sh worker HEAD_IP[:PORT] [RAY_START_ARGS...]  # on every other node
# Each node advertises its GPUs as `GPU` and as the two pool resources rlfw's placement groups ask for
# (`rollout_gpu`, `trainer_gpu`), so either pool can use any GPU. Environment:
#   RAY_PORT         the head's GCS port (default 6379)
#   RLFW_POOL_SLOTS  pool slots this node advertises (default: its GPU count). Set it on a CPU-only
#                    machine to emulate GPUs with custom resources, as the local run does.
# Useful pass-through arguments: --block (stay in the foreground and take the node down on exit, what
# srun and containers need), --temp-dir=DIR, --node-ip-address=IP, --dashboard-host=0.0.0.0 (accept job
# submissions from other hosts; the job API runs arbitrary code, so only on a trusted network).
set -euo pipefail
role="${1:?usage: ray_cluster.sh head | worker HEAD_IP[:PORT] [ray start args...]}"
shift
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
else
  gpus=0
fi
slots="${RLFW_POOL_SLOTS:-$gpus}"
resources="{\"rollout_gpu\": ${slots}, \"trainer_gpu\": ${slots}}"
port="${RAY_PORT:-6379}"
case "$role" in
  head)
    exec ray start --head --port="$port" --num-gpus="$gpus" --resources="$resources" "$@"
    ;;
  worker)
    head="${1:?usage: ray_cluster.sh worker HEAD_IP[:PORT] [ray start args...]}"
    shift
    [[ "$head" == *:* ]] || head="$head:$port"
    exec ray start --address="$head" --num-gpus="$gpus" --resources="$resources" "$@"
    ;;
  *)
    echo "unknown role $role; use head or worker" >&2
    exit 2
    ;;
esac
