#!/usr/bin/env bash
# Creates the TPU VM slice.
#   tpu_scripts/create.sh [extra gcloud flags, e.g. --spot or --reserved]
# Settings (PROJECT, ZONE, TPU_NAME, ACCELERATOR_TYPE, RUNTIME_VERSION): tpu_scripts/config.sh,
# overridable from the environment. Next: tpu_scripts/setup.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/config.sh"

gcloud compute tpus tpu-vm create "$TPU_NAME" \
  --project="$PROJECT" \
  --zone="$ZONE" \
  --accelerator-type="$ACCELERATOR_TYPE" \
  --version="$RUNTIME_VERSION" \
  "$@"
gcloud compute tpus tpu-vm describe "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" \
  --format="value(state,acceleratorType)"
