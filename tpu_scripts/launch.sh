#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Runs `car-jax train` on every worker of the slice: one process a host, the same command on all
# (JAX's multi-controller model), in the background; each worker logs to ~/car_jax_train.log.
#   tpu_scripts/launch.sh [--dry-run] CONFIG [dotted.key=value ...] [--no-check]
#   tpu_scripts/launch.sh configs/qwen2.5-3b_car_mscr.yaml model.path=/mnt/models/Qwen2.5-3B-Instruct
#   tpu_scripts/launch.sh --help
# --dry-run (or DRY_RUN=1): print the gcloud commands, one a line, and run nothing; worker 0's
# IP (see below) is then shown as WORKER0_IP. Any other flag (a typo such as --dryrun) stops
# the script before it runs anything (exit 2).
# CONFIG is a path inside the checkout on the workers (setup.sh copied configs/ there).
# Before anything reaches gcloud (dry run too), the config and the overrides are checked here,
# in this checkout: `car-jax train --check` with LOCAL_PYTHON (default: this checkout's
# .venv/bin/python). A bad key or value stops the script with car-jax's one line (exit 2).
# The check reads no data or model files (those live on the workers); --no-check skips it.
# When the config's retriever is a server on 127.0.0.1 / localhost (tpu_scripts/retriever.sh on
# worker 0), the URL is rewritten to worker 0's internal IP, which every worker can reach; an
# explicit tools.retriever=... override wins.
# Each process joins the others with CAR_JAX_DISTRIBUTED=1: jax.distributed.initialize() reads
# the coordinator, the process count and this process's id from the TPU metadata.
# Follow worker 0:  gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=0 \
#                     --command 'tail -f ~/car_jax_train.log'
# Settings (environment, defaults in tpu_scripts/config.sh): PROJECT, ZONE, TPU_NAME, REMOTE_DIR,
# RETRIEVER_PORT; LOCAL_PYTHON (the Python that runs the local check).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/config.sh"
FLAGS="--no-check"
parse_args "$@"
set -- ${ARGS[@]+"${ARGS[@]}"}

if [[ $# -lt 1 ]]; then
  echo "usage: tpu_scripts/launch.sh [--dry-run] CONFIG [dotted.key=value ...] [--no-check] (--help for more)" >&2
  exit 2
fi
CONFIG="$1"; shift
if [[ " ${OPTS[*]-} " != *" --no-check "* ]]; then
  # from the checkout's root, as the workers run it; its "config ok" line goes to stderr
  LOCAL_PYTHON="${LOCAL_PYTHON:-$HERE/../.venv/bin/python}"
  if ! command -v "$LOCAL_PYTHON" > /dev/null; then
    echo "launch.sh: no Python to check the config with ($LOCAL_PYTHON): run make venv, set LOCAL_PYTHON, or pass --no-check" >&2
    exit 2
  fi
  (cd "$HERE/.." && "$LOCAL_PYTHON" -m car_jax.cli train --check --config "$CONFIG" "$@" >&2)
fi
overrides=()
if [[ -f "$HERE/../$CONFIG" ]] &&
   grep -Eq '^[[:space:]]*retriever:[[:space:]]*"?https?://(127\.0\.0\.1|localhost)[:/]' "$HERE/../$CONFIG"; then
  describe=(gcloud compute tpus tpu-vm describe "$TPU_NAME" --project="$PROJECT" --zone="$ZONE"
            --format='value(networkEndpoints[0].ipAddress)')
  if [[ "$DRY_RUN" == 1 ]]; then
    run "${describe[@]}"
    ip=WORKER0_IP
  else
    ip="$("${describe[@]}")"
  fi
  overrides+=("tools.retriever=http://$ip:$RETRIEVER_PORT/retrieve")
fi
overrides+=("$@")  # the caller's overrides come last and win

# every word quoted for the worker's shell: spaces and quotes in an override survive
args="$(printf ' %q' train --config "$CONFIG" ${overrides[@]+"${overrides[@]}"})"
tpu_ssh all "cd $REMOTE_DIR && CAR_JAX_DISTRIBUTED=1 nohup .venv/bin/car-jax$args \
> \$HOME/car_jax_train.log 2>&1 < /dev/null & echo \"\$(hostname): started pid \$!\""
