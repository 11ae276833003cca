#!/usr/bin/env bash
# Launch TorchTitan training with titan_uniep, like TorchTitan's own run_train.sh:
#
#   NGPU=2 CONFIG_FILE=train_configs/deepseek_v3_debug_uniep.toml ./run_train.sh \
#       --training.steps 10 --debug.seed 7 --job.dump_folder out/x
#
# NGPU: processes (one per GPU; without a GPU, CPU processes over gloo). Default 2.
# CONFIG_FILE: the TOML train config. Works from any working directory.
# LOG_RANK: local ranks whose output is shown (torchrun --local-ranks-filter). Default 0.
# Extra arguments override the TOML (``--section.key value``).
set -euo pipefail

NGPU=${NGPU:-2}
LOG_RANK=${LOG_RANK:-0}
CONFIG_FILE=${CONFIG_FILE:-train_configs/deepseek_v3_debug_baseline.toml}
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# Fail at once, not after torchrun and TorchTitan have started. A relative
# CONFIG_FILE is taken from the working directory, else from this checkout
# (so CONFIG_FILE=train_configs/x.toml works from anywhere); the relative
# paths inside the configs resolve the same way (titan_uniep.preflight).
if [[ ! -f "${CONFIG_FILE}" && "${CONFIG_FILE}" != /* && -f "${REPO_ROOT}/${CONFIG_FILE}" ]]; then
    CONFIG_FILE="${REPO_ROOT}/${CONFIG_FILE}"
fi
if [[ ! -f "${CONFIG_FILE}" ]]; then
    echo "run_train.sh: CONFIG_FILE=${CONFIG_FILE} is not a file (looked in $(pwd) and ${REPO_ROOT});" \
        "pass a train config, e.g. CONFIG_FILE=train_configs/deepseek_v3_debug_uniep.toml" >&2
    exit 2
fi
python3 "${REPO_ROOT}/titan_uniep/preflight.py" "${CONFIG_FILE}" || exit 2  # TOML syntax, with line and column

# Import titan_uniep from this checkout from any working directory, installed or not.
export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
# The corpus and tokenizer are bundled; nothing may be downloaded at run time.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

if python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
else
    # CPU: share the cores between the processes instead of each one
    # starting a thread per core and thrashing.
    threads=$(( $(nproc) / NGPU ))
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}
    # UniEP's kernel schedules (EP = 1) run in Triton's interpreter, which must be
    # chosen before anything imports Triton (TorchTitan does, at start-up).
    export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
fi

# localhost:0 lets the c10d rendezvous pick a free port, so runs never collide.
exec python3 -m torch.distributed.run --nproc_per_node="${NGPU}" --rdzv_backend c10d --rdzv_endpoint=localhost:0 \
    --local-ranks-filter "${LOG_RANK}" --role rank --tee 3 \
    -m titan_uniep.train --job.config_file "${CONFIG_FILE}" "$@"
