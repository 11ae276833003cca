#!/usr/bin/env bash
# The GPU checks in one command, from the repository root of a clean clone:
# the GPU tests (simulated worlds on one GPU; real EP with 2+ GPUs), then the
# forward and forward + backward benchmarks with --check at world size =
# the GPUs present. Logs go to $OUT (default /tmp/uniep-gpu-check).
#
#   bash scripts/gpu_check.sh                     # everything
#   STEPS="tests" bash scripts/gpu_check.sh       # a subset of: tests bench bench_backward
#   STEPS="readme_tests speed probe golden" BASE=.base bash scripts/gpu_check.sh
#       readme_tests: the README's test command, every test (-n auto); on a time-out it
#           is interrupted (SIGINT), so the failures so far are still summarised;
#       speed: scripts/speed_against_commit.py --base $BASE (a commit or a folder);
#       probe: scripts/gemm_core_probe.py; golden: the bf16 golden digests (an H200's)
#   SHAPES="qwen3 4096,2048,768,128,8" REPS=20 bash scripts/gpu_check.sh   # shapes: --shape values, spaces between
#
# TorchTitan and its pure-Python dependencies: installed already, or as
# wheels in $WHEELS (default .gpu-wheels/), installed into a scratch folder.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/uniep-gpu-check}
WHEELS=${WHEELS:-.gpu-wheels}
mkdir -p "$OUT"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/uniep-site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/uniep-site:$PWD
else
    export PYTHONPATH=$PWD
fi
python3 -c 'import torchtitan' 2>/dev/null || { echo "torchtitan is not importable: pip install torchtitan==0.2.2 or put its wheels in $WHEELS/"; exit 1; }
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
[ "$NGPU" -ge 1 ] || { echo "no CUDA GPU"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } | tee "$OUT/env.txt"
STEPS=${STEPS:-tests bench bench_backward}
SHAPES=${SHAPES:-qwen3 deepseek mixtral}
shape_args=()
for s in $SHAPES; do shape_args+=(--shape "$s"); done
status=0
for step in $STEPS; do
    case $step in
    tests)
        echo "== GPU tests ($NGPU GPUs)"
        # Workers compile their kernels on the host's cores in parallel (tests/gpu/conftest.py).
        timeout "${TESTS_S:-480}" python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-14}" tests/gpu 2>&1 \
            | tee "$OUT/tests.log" | tail -15
        [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    bench | bench_backward)
        echo "== titan_uniep.tools.$step, world size $NGPU"
        timeout "${BENCH_S:-300}" python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
            -m "titan_uniep.tools.$step" "${shape_args[@]}" --check --warmup "${WARMUP:-3}" --reps "${REPS:-10}" \
            --json-out "$OUT/$step.jsonl" ${BENCH_EXTRA:-} > "$OUT/$step.log" 2>&1 || status=1
        grep -E "^\||Error|Traceback" "$OUT/$step.log" | cut -c1-300 | tail -20 ;;
    readme_tests)
        echo "== the README's test command"
        timeout -s INT -k 30 "${TESTS_S:-480}" python3 -m pytest -q -n auto --dist loadscope -p no:cacheprovider \
            -rfE > "$OUT/readme_tests.log" 2>&1 || status=1
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/readme_tests.log" | cut -c1-300 | tail -40 ;;
    speed)
        echo "== the default point against ${BASE:?BASE=<commit or folder>}"
        timeout "${BENCH_S:-300}" python3 scripts/speed_against_commit.py --base "$BASE" "${shape_args[@]}" \
            > "$OUT/speed.log" 2>&1 || status=1
        tail -8 "$OUT/speed.log" ;;
    probe)
        echo "== GEMM cores alone"
        timeout "${BENCH_S:-300}" python3 scripts/gemm_core_probe.py "${shape_args[@]}" --json-out "$OUT/probe.jsonl" \
            > "$OUT/probe.log" 2>&1 || status=1
        grep -E "^\||peak" "$OUT/probe.log" | tail -30 ;;
    golden)
        echo "== bf16 golden digests"
        python3 tests/golden/make_golden.py --check tests/golden/h200_bf16.json > "$OUT/golden.log" 2>&1 || status=1
        tail -5 "$OUT/golden.log" ;;
    *) echo "unknown step $step (tests, bench, bench_backward, readme_tests, speed, probe, golden)"; exit 2 ;;
    esac
done
exit $status
