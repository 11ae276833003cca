#!/usr/bin/env bash
# One device call (2 GPUs) after making descriptor loads the default for the backward's dA
# (BACKWARD_TILES["da_tma"]): GPU tests, the real 2-GPU workers, forward + backward bench --check.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
DIST="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_simulated.py tests/gpu/test_gpu_backward.py > /tmp/gpu.log 2>&1; echo "gpu tests exit $?"; tail -1 /tmp/gpu.log; grep -E "^FAILED|Error" /tmp/gpu.log | head -8
timeout 70 $DIST tests/gpu/ep_worker.py > /tmp/epf.log 2>&1; echo "ep forward exit $?: $(grep -c PASS /tmp/epf.log) PASS"; grep -E "FAIL|Error" /tmp/epf.log | head -5
timeout 70 $DIST tests/gpu/ep_backward_worker.py > /tmp/epb.log 2>&1; echo "ep backward exit $?: $(grep -c PASS /tmp/epb.log) PASS"; grep -E "FAIL|Error" /tmp/epb.log | head -5
timeout 180 $DIST -m titan_uniep.bench_backward --shapes qwen3,deepseek,mixtral --check --warmup 2 --reps 5 > /tmp/bwd.log 2>&1; echo "bwd exit $?"
grep -E "^\|" /tmp/bwd.log; grep -o '"bitwise_fused_eq_sequential": [a-z]*' /tmp/bwd.log; grep -E "Error|Traceback" /tmp/bwd.log | head -3
