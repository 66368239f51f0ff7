#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Starts the Search-R1 retrieval server (`car-jax serve-retriever`, POST /retrieve) on worker 0,
# over Search-R1's E5 index of the 2018 Wikipedia dump, and waits until GET /health answers.
#   tpu_scripts/retriever.sh [--dry-run]
#   tpu_scripts/retriever.sh --help
# --dry-run (or DRY_RUN=1): print the gcloud commands, one a line, and run nothing.
# Any other flag or argument (a typo such as --dryrun) stops the script before it runs anything.
# Needs on worker 0, under SEARCH_DATA (default ~/search_r1):
#   e5_Flat.index   Search-R1's FAISS flat index (PeterJinGo/wiki-18-e5-index, joined parts)
#   wiki-18.jsonl   the corpus whose rows match the index (PeterJinGo/wiki-18-corpus)
#   e5-base-v2/     the encoder as an HF folder (intfloat/e5-base-v2); "e5" in the folder name
#                   turns on E5's "query: " prefix and mean pooling settings
# The flat index is about 60 GB of host RAM. The server runs on the host CPUs (JAX_PLATFORMS=cpu)
# so that the TPU chips stay free for training; it binds 0.0.0.0 so every worker reaches it on
# worker 0's internal IP (tpu_scripts/launch.sh points the run there). Log: ~/car_jax_retriever.log.
# Settings (environment, defaults in tpu_scripts/config.sh): PROJECT, ZONE, TPU_NAME, REMOTE_DIR,
# RETRIEVER_PORT; SEARCH_DATA (a folder on worker 0), WAIT_S (seconds to wait for /health, 1800).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/config.sh"
parse_args "$@"
no_args ${ARGS[@]+"${ARGS[@]}"}
SEARCH_DATA="${SEARCH_DATA:-\$HOME/search_r1}"  # expanded on worker 0
WAIT_S="${WAIT_S:-1800}"  # how long to wait for the index to load

tpu_ssh 0 "cd $REMOTE_DIR && JAX_PLATFORMS=cpu nohup .venv/bin/car-jax serve-retriever \
--faiss-index $SEARCH_DATA/e5_Flat.index --corpus $SEARCH_DATA/wiki-18.jsonl \
--encoder $SEARCH_DATA/e5-base-v2 --host 0.0.0.0 --port $RETRIEVER_PORT \
> \$HOME/car_jax_retriever.log 2>&1 < /dev/null &"

# poll /health from worker 0 itself until the server answers (loading the index takes minutes)
tpu_ssh 0 "for i in \$(seq 1 $WAIT_S); do \
if curl -sf http://127.0.0.1:$RETRIEVER_PORT/health; then echo; exit 0; fi; sleep 1; done; \
echo 'retriever did not answer within $WAIT_S s; see ~/car_jax_retriever.log' >&2; \
tail -n 20 \$HOME/car_jax_retriever.log >&2; exit 1"
