#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Deletes the TPU VM slice (and with it everything on its disks: copy checkpoints off first,
# or keep run.dir on a shared mount).
#   tpu_scripts/teardown.sh            # gcloud asks for confirmation
#   tpu_scripts/teardown.sh --quiet    # it does not ask (extra flags go to gcloud)
#   tpu_scripts/teardown.sh --dry-run  # print the gcloud command (also DRY_RUN=1), run nothing
#   tpu_scripts/teardown.sh --help
# Settings (environment, defaults in tpu_scripts/config.sh): PROJECT, ZONE, TPU_NAME.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/config.sh"
while [[ $# -gt 0 ]] && common_option "$1"; do shift; done

run gcloud compute tpus tpu-vm delete "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" "$@"
