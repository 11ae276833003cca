#!/usr/bin/env bash
# Launch TorchTitan training with titan_uniep, like TorchTitan's own run_train.sh:
#
#   NGPU=2 CONFIG_FILE=train_configs/deepseek_v3_debug_uniep.toml ./run_train.sh \
#       --training.steps 10 --debug.seed 7 --job.dump_folder out/x
#
# NGPU: processes (one per GPU; without a GPU, CPU processes over gloo). Default 2.
# LOG_RANK: local ranks whose output is shown (torchrun --local-ranks-filter). Default 0.
# Extra arguments override the TOML (``--section.key value``).
set -euo pipefail

NGPU=${NGPU:-2}
LOG_RANK=${LOG_RANK:-0}
CONFIG_FILE=${CONFIG_FILE:-train_configs/deepseek_v3_debug_baseline.toml}
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

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
