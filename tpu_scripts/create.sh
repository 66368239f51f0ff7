#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Creates the TPU VM slice, then prints its state and accelerator type.
#   tpu_scripts/create.sh [--dry-run] [extra gcloud flags, e.g. --spot or --reserved]
#   tpu_scripts/create.sh --help
# --dry-run (or DRY_RUN=1): print the gcloud commands, one a line, and run nothing.
# Settings (environment, defaults in tpu_scripts/config.sh): PROJECT, ZONE, TPU_NAME,
# ACCELERATOR_TYPE, RUNTIME_VERSION. Next: tpu_scripts/setup.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/config.sh"
while [[ $# -gt 0 ]] && common_option "$1"; do shift; done

run gcloud compute tpus tpu-vm create "$TPU_NAME" \
  --project="$PROJECT" \
  --zone="$ZONE" \
  --accelerator-type="$ACCELERATOR_TYPE" \
  --version="$RUNTIME_VERSION" \
  "$@"
run gcloud compute tpus tpu-vm describe "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" \
  --format="value(state,acceleratorType)"
