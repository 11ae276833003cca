#!/usr/bin/env bash
# Everything the kernels need from the GPU machine, in one command: the
# one-GPU simulated-world tests, the 2-GPU real-EP checks and the benchmark.
# Logs go to $OUT. Usage (repo root, 2 GPUs): bash tests/gpu/device_run.sh
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
{ nvidia-smi --query-gpu=name,driver_version --format=csv; nvidia-smi topo -m
  python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count())'; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
SIM_S=${SIM_S:-100} EP_S=${EP_S:-100} BENCH_S=${BENCH_S:-180}
echo "== simulated world, one GPU"
timeout "$SIM_S" python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gpu_simulated.py 2>&1 | tee "$OUT/sim.log" | tail -40
echo "== real EP, 2 GPUs"
timeout "$EP_S" python3 -m torch.distributed.run --standalone --nproc_per_node 2 tests/gpu/ep_worker.py \
    > "$OUT/ep.log" 2>&1; echo "ep_worker exit $?"; grep -E "PASS|OK|Error|error|Traceback|assert" "$OUT/ep.log" | head -40
echo "== benchmark"
timeout "$BENCH_S" python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m titan_uniep.bench \
    --shapes "${SHAPES:-qwen3,deepseek,mixtral}" --routing "${ROUTING:-balanced}" --check \
    --warmup "${WARMUP:-3}" --reps "${REPS:-10}" ${BENCH_EXTRA:-} --json-out "$OUT/bench.jsonl" > "$OUT/bench.log" 2>&1; echo "bench exit $?"
grep -E "^\||JSON|Error|error|Traceback" "$OUT/bench.log" | cut -c1-2500 | tail -30
if [ -n "${AB_S:-}" ]; then
    echo "== A/B of kernel configs (tests/gpu/ab_configs.py)"
    timeout "$AB_S" python3 -m torch.distributed.run --standalone --nproc_per_node 2 tests/gpu/ab_configs.py \
        --shapes "${SHAPES:-qwen3,deepseek,mixtral}" > "$OUT/ab.log" 2>&1; echo "ab exit $?"; grep -E "^AB|Error|Traceback" "$OUT/ab.log"
fi
