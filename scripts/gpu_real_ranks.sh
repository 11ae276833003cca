#!/usr/bin/env bash
# Real-rank mode on one GPU (titan_uniep.tools.real_ranks): the EP path as the ranks of
# a real group run it, W ranks in one process. From the repository root of a clean clone:
#
#   bash scripts/gpu_real_ranks.sh                          # every step
#   STEPS="tests failures" bash scripts/gpu_real_ranks.sh   # a subset of the steps below
#   WORLDS="2 4" CASES="after" CALLS=200 bash scripts/gpu_real_ranks.sh
#
# Steps: compile (every case and world's kernels into Triton's cache, in parallel
# processes), tests (the GPU tests of real ranks and of the waits' uniform exits),
# stress (CALLS consecutive calls per case and world, bitwise against the simulated
# world's sequential schedule), failures (every injected failure at W = 2 and 4),
# sanitizer (compute-sanitizer's synccheck, racecheck and memcheck on the tiny case at
# W = 2: its calls, then its failures), mutants (scripts/mutate.py --device gpu: the
# waits' and the exchange's fixes undone one at a time, each must turn a GPU test red).
# Logs in $OUT (default /tmp/uniep-real-ranks).
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/uniep-real-ranks}
mkdir -p "$OUT"
STEPS=${STEPS:-compile tests stress failures sanitizer}
WORLDS=${WORLDS:-2 4 8}
CASES=${CASES:-after before empty_rank}
CALLS=${CALLS:-1000}
TOOL="python3 -m titan_uniep.tools.real_ranks"
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA GPU"; print(torch.cuda.get_device_name(), "torch", torch.__version__)' \
    | tee "$OUT/env.txt" || exit 1
world_args=() case_args=()
for w in $WORLDS; do world_args+=(--world "$w"); done
for c in $CASES; do case_args+=(--case "$c"); done
status=0
run() {  # name, limit in seconds, command...
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    grep -E "^(STRESS|FAIL-INJECT|COMPILED|baseline)|passed|failed|killed|survived|timed out|ERROR SUMMARY|RACECHECK SUMMARY|Error|Traceback" "$OUT/$name.log" | cut -c1-400 | tail -40
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    [ "$rc" = 0 ] || status=1
}
for step in $STEPS; do
    case $step in
    compile)
        start=$SECONDS pids=()
        for c in $CASES tiny; do for w in $WORLDS; do
            $TOOL --case "$c" --world "$w" --compile-only > "$OUT/compile-$c-$w.log" 2>&1 &
            pids+=($!)
        done; done
        for pid in "${pids[@]}"; do wait "$pid" || status=1; done
        grep -h "COMPILED\|Error" "$OUT"/compile-*.log | tr '\n' ' '
        echo; echo "== compile: $((SECONDS - start)) s" ;;
    tests) run tests "${TESTS_S:-600}" python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-4}" \
               tests/gpu/test_gpu_real_ranks.py tests/gpu/test_gpu_uniform_waits.py ;;
    stress) run stress "${STRESS_S:-900}" $TOOL "${world_args[@]}" "${case_args[@]}" --calls "$CALLS" ;;
    failures) run failures 300 $TOOL --world 2 --world 4 --case after --fail all ;;
    sanitizer)
        for tool in ${SANITIZERS:-synccheck racecheck memcheck}; do
            run "sanitizer-$tool" "${SANITIZER_S:-300}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
                $TOOL --world 2 --case tiny --calls 2 --sets 2 --timeout-s 30
            run "sanitizer-$tool-failures" "${SANITIZER_S:-300}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
                $TOOL --world 2 --case tiny --fail silent --fail bad_slot --fail mid_tile --bound-s 5
        done ;;
    mutants) run mutants "${MUTANTS_S:-600}" python3 scripts/mutate.py --device gpu --no-baseline --jobs 4 --limit-s 150 ;;
    *) echo "unknown step $step (compile tests stress failures sanitizer mutants)"; exit 2 ;;
    esac
done
exit $status
