#!/usr/bin/env bash
# The backward's GPU checks in one command (repo root, 2 GPUs): the one-GPU
# simulated-world tests (bf16), the real 2-GPU check and the fwd+bwd benchmark.
# Logs go to $OUT. Usage: bash tests/gpu/device_run_backward.sh
# (BENCH_EXTRA: more bench_backward arguments, e.g. "--profile --sweep-tiles '[...]'").
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/uniep-out}
mkdir -p "$OUT"
if ls .gpu-wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
SIM_S=${SIM_S:-80} EP_S=${EP_S:-80} BENCH_S=${BENCH_S:-170}
echo "== backward, simulated world, one GPU"
timeout "$SIM_S" python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gpu_backward.py 2>&1 | tee "$OUT/bwd_sim.log" | tail -25
echo "== backward, real EP, 2 GPUs"
timeout "$EP_S" python3 -m torch.distributed.run --standalone --nproc_per_node 2 tests/gpu/ep_backward_worker.py \
    > "$OUT/bwd_ep.log" 2>&1; echo "ep_backward_worker exit $?"; grep -E "PASS|FAIL|Error|error|Traceback" "$OUT/bwd_ep.log" | head -40
echo "== fwd+bwd benchmark"
timeout "$BENCH_S" python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m titan_uniep.bench_backward \
    --shapes "${SHAPES:-qwen3,deepseek}" --check --warmup "${WARMUP:-2}" --reps "${REPS:-5}" \
    --json-out "$OUT/bwd_bench.jsonl" ${BENCH_EXTRA:-} > "$OUT/bwd_bench.log" 2>&1; echo "bench_backward exit $?"
grep -E "^\||JSON|Error|error|Traceback|failed|PROFILE.*(kernels|_kernel)" "$OUT/bwd_bench.log" | cut -c1-2500 | tail -40
