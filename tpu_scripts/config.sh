# Settings and helpers shared by the tpu_scripts (sourced by each of them, not run).
# Every setting can be overridden from the environment, e.g.
#   PROJECT=my-project TPU_NAME=car-32b ACCELERATOR_TYPE=v5p-128 tpu_scripts/create.sh
# shellcheck shell=bash
PROJECT="${PROJECT:-my-gcp-project}"            # GCP project id
ZONE="${ZONE:-us-east5-a}"                      # a zone that has the accelerator type
TPU_NAME="${TPU_NAME:-car-jax}"                 # name of the TPU VM (slice)
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v5p-8}"   # v5p-8: 4 chips, 1 host; v5p-128: 64 chips, 16 hosts
RUNTIME_VERSION="${RUNTIME_VERSION:-v2-alpha-tpuv5}"  # v5p software image (`gcloud compute tpus tpu-vm versions list`)
REPO_URL="${REPO_URL:-}"                        # git URL to clone on the workers; empty: copy this checkout
REMOTE_DIR="${REMOTE_DIR:-car_jax}"             # checkout folder in each worker's home
RETRIEVER_PORT="${RETRIEVER_PORT:-8000}"        # Search-R1 /retrieve server on worker 0
DRY_RUN="${DRY_RUN:-0}"                         # 1 (or --dry-run): print the commands, run none
FLAGS=""                                        # a script's own flags, for parse_args

# The script's header comment (its usage and settings), without the '#'s and directives.
usage() {
  awk 'NR == 1 || /^# shellcheck / { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
}

# Reads a script's arguments before it runs anything: --help and --dry-run (every script's),
# the flags the script lists in FLAGS (collected in OPTS, in order; "--" in FLAGS: the words
# after a "--" go to OPTS as they are, for gcloud) and the other words (into ARGS). Any other
# word that starts with "-" (a typo such as --dryrun) stops the script: one line naming it
# and the known flags, exit 2.
#   FLAGS="--spot --"; parse_args "$@"; set -- ${ARGS[@]+"${ARGS[@]}"}
parse_args() {
  ARGS=() OPTS=()
  local known=" ${FLAGS:-} "
  while [[ $# -gt 0 ]]; do
    case "$1" in
      -h|--help) usage; exit 0 ;;
      --dry-run) DRY_RUN=1 ;;
      --) if [[ "$known" == *" -- "* ]]; then shift; OPTS+=("$@"); break; fi; unknown_flag "$1" ;;
      -*) if [[ "$known" == *" $1 "* ]]; then OPTS+=("$1"); else unknown_flag "$1"; fi ;;
      *) ARGS+=("$1") ;;
    esac
    shift
  done
}

unknown_flag() {
  local known="--help --dry-run${FLAGS:+ $FLAGS}"
  echo "$(basename "$0"): unknown flag '$1'; known: ${known// /, } (see $(basename "$0") --help)" >&2
  exit 2
}

# Refuses positional arguments, for a script that takes none (one line, exit 2).
no_args() {
  if [[ $# -gt 0 ]]; then
    echo "$(basename "$0"): unexpected argument '$1' (see $(basename "$0") --help)" >&2
    exit 2
  fi
}

# One word quoted so that a shell reads it back unchanged: bare when it is plain, else in
# single quotes (a --flag=value word: its value); a word with a newline as $'...' so that
# each command stays on one line.
quote_word() {
  local word="$1" escaped="'\\''"
  if [[ "$word" =~ ^(--[A-Za-z0-9-]+=)(.+)$ ]]; then
    printf '%s' "${BASH_REMATCH[1]}"
    quote_word "${BASH_REMATCH[2]}"
  elif [[ -n "$word" && "$word" != *[!A-Za-z0-9_@%+=:,./-]* ]]; then
    printf '%s' "$word"
  elif [[ "$word" == *$'\n'* ]]; then
    printf '%q' "$word"
  else
    printf "'%s'" "${word//\'/$escaped}"
  fi
}

# Runs a command; with DRY_RUN=1 prints it instead, quoted, on one line of stdout.
run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    local word line=""
    for word in "$@"; do line+=" $(quote_word "$word")"; done
    printf '%s\n' "${line# }"
  else
    "$@"
  fi
}

# gcloud ssh to WORKER ("all", or an index) of the slice, running COMMAND there.
tpu_ssh() {
  local worker="$1"; shift
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" \
    --worker="$worker" --command="$*"
}
