#!/usr/bin/env bash
# One device call (2 GPUs): the GEMM + combine megakernels (forward B, backward BB)
# under tile / programs-per-SM / deferred-release variants (scripts/probe_combine.py).
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts
FWD=${FWD:-'[{}, {"defer_release": true}, {"block_n_fc2": 128}, {"block_n_fc2": 128, "fc2_num_warps": 4, "fc2_programs_per_sm": 2}, {"block_n_fc2": 128, "fc2_num_warps": 4, "fc2_programs_per_sm": 2, "defer_release": true}, {"block_n_fc2": 128, "fc2_max_registers": 128, "fc2_programs_per_sm": 2}, {"block_n_fc2": 128, "fc2_max_registers": 128, "fc2_programs_per_sm": 2, "defer_release": true}]'}
BWD=${BWD:-'[{}, {"da_defer_release": true}, {"da_bk": 32}, {"da_bk": 32, "da_warps": 4, "da_programs_per_sm": 2}, {"da_bk": 32, "da_warps": 4, "da_programs_per_sm": 2, "da_defer_release": true}, {"da_bk": 32, "da_max_registers": 128, "da_programs_per_sm": 2}, {"da_bk": 32, "da_max_registers": 128, "da_programs_per_sm": 2, "da_defer_release": true}]'}
timeout ${T1:-400} python3 -m torch.distributed.run --standalone --nproc_per_node 2 scripts/probe_combine.py \
    --shape ${SHAPE:-qwen3} --forward "$FWD" --backward "$BWD" > /tmp/probe.log 2>&1
echo "exit $?"
grep -E "PROBE|Error|error" /tmp/probe.log | head -40
