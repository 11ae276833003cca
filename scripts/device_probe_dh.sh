#!/usr/bin/env bash
# One-GPU device call: dH / dA phase kernel times for tile overrides (scripts/probe_dh.py).
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
V=${VARIANTS:-'[{}, {"_recompute": true}, {"dh": 64}, {"bk": 32}, {"bk": 128}, {"stages": 4}, {"warps": 4}]'}
for s in ${SHAPES:-qwen3 mixtral}; do
  timeout ${PROBE_S:-200} python3 scripts/probe_dh.py --shape $s --variants "$V" 2>&1 | grep -v -i warn | tail -12
done
