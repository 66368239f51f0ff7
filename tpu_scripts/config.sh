# Settings shared by the tpu_scripts (sourced by each of them, not run).
# Every value can be overridden from the environment, e.g.
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

# gcloud ssh to WORKER ("all", or an index) of the slice, running COMMAND there.
tpu_ssh() {
  local worker="$1"; shift
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" \
    --worker="$worker" --command="$*"
}
