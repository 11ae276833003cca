#!/usr/bin/env bash
# Launch TorchTitan training with titan_uniep, like TorchTitan's own run_train.sh:
#
#   NGPU=2 CONFIG_FILE=train_configs/deepseek_v3_debug_uniep.toml ./run_train.sh \
#       --training.steps 10 --debug.seed 7 --job.dump_folder out/x
#
# NGPU: processes (one per GPU; without a GPU, CPU processes over gloo). Default 2.
# CONFIG_FILE: the TOML train config. Works from any working directory.
# LOG_RANK: local ranks whose output is shown (torchrun --local-ranks-filter). Default 0.
#   Every rank's output is also kept under <job.dump_folder>/logs.
# Extra arguments override the TOML (``--section.key value``).
set -euo pipefail

NGPU=${NGPU:-2}
LOG_RANK=${LOG_RANK:-0}
CONFIG_FILE=${CONFIG_FILE:-train_configs/deepseek_v3_debug_baseline.toml}
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# Fail at once, not after torchrun and TorchTitan have started (about 10 s on
# 2 cores). A relative CONFIG_FILE is taken from the working directory, else
# from this checkout (so CONFIG_FILE=train_configs/x.toml works from anywhere);
# the relative paths inside the configs resolve the same way (titan_uniep.torchtitan.preflight).
if [[ ! -f "${CONFIG_FILE}" && "${CONFIG_FILE}" != /* && -f "${REPO_ROOT}/${CONFIG_FILE}" ]]; then
    CONFIG_FILE="${REPO_ROOT}/${CONFIG_FILE}"
fi
if [[ ! -f "${CONFIG_FILE}" ]]; then
    looked_in="$(pwd)"
    [[ "${looked_in}" -ef "${REPO_ROOT}" ]] || looked_in="${looked_in} and ${REPO_ROOT}"
    echo "run_train.sh: CONFIG_FILE=${CONFIG_FILE} is not a file (looked in ${looked_in});" \
        "pass a train config, e.g. CONFIG_FILE=train_configs/deepseek_v3_debug_uniep.toml" >&2
    exit 2
fi
# Import titan_uniep from this checkout from any working directory, installed or not.
export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"

# The worker's first checks, with the standard library only (~0.1 s): TOML syntax,
# [uniep] keys and values, NGPU against the [parallelism] degrees, of the file and
# the overrides. It prints the job's dump folder, where torchrun keeps every rank's
# output (not a /tmp/torchelastic_* folder per run).
DUMP_FOLDER=$(python3 -m titan_uniep.torchtitan.preflight "${NGPU}" --job.config_file "${CONFIG_FILE}" "$@") \
    || exit 2
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

# torchrun (titan_uniep/torchtitan/torchrun.py: the same arguments; when a worker
# fails, a short report ending with its error instead of torchrun's traceback).
# localhost:0 lets the c10d rendezvous pick a free port, so runs never collide.
# titan_uniep.torchtitan.train runs the trainer of the installed TorchTitan's edge.
exec python3 -m titan_uniep.torchtitan.torchrun --nproc_per_node="${NGPU}" --rdzv_backend c10d \
    --rdzv_endpoint=localhost:0 --local-ranks-filter "${LOG_RANK}" --role rank --tee 3 \
    --log-dir "${DUMP_FOLDER}/logs" -m titan_uniep.torchtitan.train --job.config_file "${CONFIG_FILE}" "$@"
