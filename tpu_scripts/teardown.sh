#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Deletes the TPU VM slice (and with it everything on its disks: copy checkpoints off first,
# or keep run.dir on a shared mount).
#   tpu_scripts/teardown.sh            # gcloud asks for confirmation
#   tpu_scripts/teardown.sh --quiet    # it does not ask (--quiet, --async and the words
#                                      # after "--" go to gcloud)
#   tpu_scripts/teardown.sh --dry-run  # print the gcloud command (also DRY_RUN=1), run nothing
#   tpu_scripts/teardown.sh --help
# Any other flag (a typo such as --dryrun) stops the script before it runs anything (exit 2).
# Settings (environment, defaults in tpu_scripts/config.sh): PROJECT, ZONE, TPU_NAME.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/config.sh"
FLAGS="--quiet --async --"
parse_args "$@"
no_args ${ARGS[@]+"${ARGS[@]}"}

run gcloud compute tpus tpu-vm delete "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" ${OPTS[@]+"${OPTS[@]}"}
