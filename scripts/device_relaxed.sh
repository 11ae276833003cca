#!/usr/bin/env bash
# One device call (2 GPUs) after making the task-claim atomics relaxed: the real 2-GPU
# forward and backward workers (bitwise, no host sync), then the forward and fwd+bwd benchmarks.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 60 python3 -m torch.distributed.run --standalone --nproc_per_node 2 tests/gpu/ep_backward_worker.py > /tmp/epb.log 2>&1; echo "ep backward exit $?"; grep -c PASS /tmp/epb.log; grep -E "FAIL|Error" /tmp/epb.log | head -5
timeout 60 python3 -m torch.distributed.run --standalone --nproc_per_node 2 tests/gpu/ep_worker.py > /tmp/epf.log 2>&1; echo "ep forward exit $?"; grep -c PASS /tmp/epf.log; grep -E "FAIL|Error" /tmp/epf.log | head -5
timeout 70 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m titan_uniep.bench --shapes qwen3,deepseek,mixtral --check --warmup 3 --reps 10 > /tmp/fwd.log 2>&1; echo "fwd exit $?"; grep -E "^\|" /tmp/fwd.log; grep -o '"check_fused_equals_sequential": [a-z]*' /tmp/fwd.log
timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m titan_uniep.bench_backward --shapes qwen3,deepseek,mixtral --check --warmup 2 --reps 5 > /tmp/bwd.log 2>&1; echo "bwd exit $?"; grep -E "^\|" /tmp/bwd.log; grep -o '"bitwise_fused_eq_sequential": [a-z]*' /tmp/bwd.log
