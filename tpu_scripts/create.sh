#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Creates the TPU VM slice, then prints its state and accelerator type.
#   tpu_scripts/create.sh [--dry-run] [--spot] [--reserved] [--preemptible] [-- other gcloud flags]
#   tpu_scripts/create.sh --spot -- --network=my-net --labels=team=rl
#   tpu_scripts/create.sh --help
# --dry-run (or DRY_RUN=1): print the gcloud commands, one a line, and run nothing.
# --spot, --reserved, --preemptible and every word after "--" are passed on to
# `gcloud ... create`; any other flag (a typo such as --dryrun) stops the script before it
# runs anything (exit 2).
# Settings (environment, defaults in tpu_scripts/config.sh): PROJECT, ZONE, TPU_NAME,
# ACCELERATOR_TYPE, RUNTIME_VERSION. Next: tpu_scripts/setup.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/config.sh"
FLAGS="--spot --reserved --preemptible --"
parse_args "$@"
no_args ${ARGS[@]+"${ARGS[@]}"}

run gcloud compute tpus tpu-vm create "$TPU_NAME" \
  --project="$PROJECT" \
  --zone="$ZONE" \
  --accelerator-type="$ACCELERATOR_TYPE" \
  --version="$RUNTIME_VERSION" \
  ${OPTS[@]+"${OPTS[@]}"}
run gcloud compute tpus tpu-vm describe "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" \
  --format="value(state,acceleratorType)"
