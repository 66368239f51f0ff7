#!/usr/bin/env bash
# Runs `car-jax train` on every worker of the slice: one process a host, the same command on all
# (JAX's multi-controller model), in the background; each worker logs to ~/car_jax_train.log.
#   tpu_scripts/launch.sh CONFIG [dotted.key=value ...]
#   tpu_scripts/launch.sh configs/qwen2.5-3b_car_mscr.yaml model.path=/mnt/models/Qwen2.5-3B-Instruct
# CONFIG is a path inside the checkout on the workers (setup.sh copied configs/ there).
# When the config's retriever is a server on 127.0.0.1 / localhost (tpu_scripts/retriever.sh on
# worker 0), the URL is rewritten to worker 0's internal IP, which every worker can reach.
# Multi-host: the process starts through a one-line Python wrapper that initialises
# jax.distributed before running the CLI (the CLI would also do it with CAR_JAX_DISTRIBUTED=1;
# see tpu_scripts/README.md).
# Follow worker 0:  gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=0 \
#                     --command 'tail -f ~/car_jax_train.log'
# Settings: tpu_scripts/config.sh (PROJECT, ZONE, TPU_NAME, ..., REMOTE_DIR, RETRIEVER_PORT).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/config.sh"

if [[ $# -lt 1 ]]; then
  sed -n '2,5p' "${BASH_SOURCE[0]}" >&2
  exit 2
fi
CONFIG="$1"; shift
overrides=()
if [[ -f "$HERE/../$CONFIG" ]] &&
   grep -Eq '^[[:space:]]*retriever:[[:space:]]*"?https?://(127\.0\.0\.1|localhost)[:/]' "$HERE/../$CONFIG"; then
  ip="$(gcloud compute tpus tpu-vm describe "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" \
        --format='value(networkEndpoints[0].ipAddress)')"
  overrides+=("tools.retriever=http://$ip:$RETRIEVER_PORT/retrieve")
fi
overrides+=("$@")  # the caller's overrides come last and win

# jax.distributed.initialize() finds the coordinator, the process count and this process's id
# in the TPU metadata; it must run before any other JAX call.
WRAPPER='import sys, jax
if not jax.distributed.is_initialized():
    jax.distributed.initialize()
from car_jax.cli import main
sys.exit(main())'

args="$(printf ' %q' train --config "$CONFIG" "${overrides[@]}")"
tpu_ssh all "cd $REMOTE_DIR && nohup .venv/bin/python -c $(printf '%q' "$WRAPPER")$args \
  > \$HOME/car_jax_train.log 2>&1 < /dev/null & echo \"\$(hostname): started pid \$!\""
