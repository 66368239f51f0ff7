#!/usr/bin/env bash
# Deletes the TPU VM slice (and with it everything on its disks: copy checkpoints off first,
# or keep run.dir on a shared mount).
#   tpu_scripts/teardown.sh          # asks for confirmation
#   tpu_scripts/teardown.sh --quiet  # does not ask
# Settings: tpu_scripts/config.sh (PROJECT, ZONE, TPU_NAME).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/config.sh"

gcloud compute tpus tpu-vm delete "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" "$@"
