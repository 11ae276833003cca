#!/usr/bin/env bash
# GPU runs of the tuning space and model, from a clean clone, on H200s.
#   STEP=constants bash scripts/tuning_gpu.sh    # one GPU, about 3 min cold: out/tuning/h200.json
#   STEP=bits1 / STEP=bits2 bash scripts/tuning_gpu.sh  # one GPU, < 10 min each: which fields keep the bits in bf16
#   STEP=constants_x2 bash scripts/tuning_gpu.sh # two GPUs: adds NVLink and the counts exchange
#   STEP=variants bash scripts/tuning_gpu.sh     # CPU is enough: the model's verdict per optional path
#   STEP=check MEASURED=m.json bash scripts/tuning_gpu.sh  # the model against measured times (calibrate's format)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p out/tuning
case "${STEP:?set STEP}" in
  constants)
    python -m titan_uniep.tuning.calibrate --out out/tuning/h200.json ;;
  constants_grid)  # every tile configuration of the search grid (slower: one compile each)
    python -m titan_uniep.tuning.calibrate --out out/tuning/h200_grid.json --tiles grid ;;
  constants_x2)
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 \
      torchrun --standalone --nproc_per_node 2 -m titan_uniep.tuning.calibrate --out out/tuning/h200_x2.json ;;
  bits1)  # fields that shape GEMM tiles and the layouts of in-kernel sums (tl.sum order follows the layout)
    python scripts/check_schedule_bits.py --device cuda --values 1 --json out/tuning/bits_cuda_1.json \
      --fields block_m,fc1_block_n,fc1_num_warps,fc1_one_dot,fc2_block_n,fc2_num_warps,dh_num_warps,da_block_n,da_num_warps,reduce_block_tokens,reduce_block_dim ;;
  bits2)  # the rest of the schedule fields with a GPU-only effect, and the numerics ones
    python scripts/check_schedule_bits.py --device cuda --values 1 --json out/tuning/bits_cuda_2.json \
      --fields group_m,dispatch_block_tokens,fc1_num_stages,fc2_num_stages,fc2_programs_per_sm,fc2_max_registers,fc2_tma,dh_num_stages,dh_programs_per_sm,da_num_stages,da_programs_per_sm,da_max_registers,da_tma,fc2_defer_release,wgrad_backend ;;
  variants)
    python scripts/variant_report.py ${CONSTANTS:+--constants "$CONSTANTS"} --worlds 1,2 ;;
  check)
    python -m titan_uniep.tuning.calibrate check --constants "${CONSTANTS:-out/tuning/h200_x2.json}" --measurements "${MEASURED:?}" ;;
  *) echo "unknown STEP=$STEP" >&2; exit 2 ;;
esac
