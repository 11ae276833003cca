#!/usr/bin/env bash
# One-GPU device call: the weight-gradient kernel probe and the forward h1|h3-store probe.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout ${WGRAD_S:-330} python3 scripts/probe_wgrad.py --shapes ${SHAPES:-mixtral,deepseek,qwen3} 2>&1 | grep -v Warning
echo "wgrad exit $?"
timeout ${FWD_S:-150} python3 scripts/probe_forward_save.py --shape mixtral 2>&1 | grep -v Warning | tail -8
echo "fwd exit $?"
