#!/usr/bin/env bash
# The measured tuning on one GPU (an H200), from the repository root of a clean
# clone, in about 10 minutes of wall time:
#
#   calibrate  the tuning model's hardware constants (titan_uniep.tuning.calibrate)
#   tune       python -m titan_uniep.tools.tune on the five tuning shapes at EP 1
#              (titan_uniep.shapes.TUNING_SHAPES), into $WORK/tuning.json
#   report     bench --check --report and bench_backward --check --report on
#              the same shapes: TorchTitan, UniEP default and tuned, GEMM-only,
#              the model's prediction and its per-stage breakdown
#
#   bash scripts/tune_h200.sh
#   STEPS="tune report" SHAPES="qwen3_1gpu odd_dim" TOP=6 bash scripts/tune_h200.sh   # --shape values
#   CALIBRATE_ARGS="--tiles grid" bash scripts/tune_h200.sh     # every grid tile measured
#
# Every step runs under a timeout (CALIBRATE_S 170, TUNE_S 420, REPORT_S 100 per
# bench), cut to what is left of TOTAL_S (default 600 s), so the results come
# back even when a step runs long; the tuner writes its cache after every
# shape, so a cut tuning run still reports the shapes it finished. To split
# the work over two calls on a warm machine, give both the same WORK folder:
#   WORK=/tmp/uniep-tune-work STEPS=calibrate CALIBRATE_ARGS="--tiles grid" bash scripts/tune_h200.sh
#   WORK=/tmp/uniep-tune-work STEPS="tune report" bash scripts/tune_h200.sh
# (the second reads the first's $WORK/constants.json; copy it into a new WORK
# folder if the machine was not kept between the calls)
# Results in $OUT (default /tmp/uniep-tune), at most 8 files: summary.txt, tuning.json,
# constants.json, forward.md, backward.md, tune.log, and results.tar.gz with
# everything (logs, JSON lines, the PNG plots).
# TorchTitan and its pure-Python dependencies: installed already, or as
# wheels in $WHEELS (default .gpu-wheels/), installed into a scratch folder.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# Compiled kernels survive between steps (the tuner compiles what the benches run).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/uniep-triton-cache}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
START=$SECONDS
TOTAL_S=${TOTAL_S:-600}
OUT=${OUT:-/tmp/uniep-tune}
WORK=${WORK:-$(mktemp -d /tmp/uniep-tune-work.XXXXXX)}
WHEELS=${WHEELS:-.gpu-wheels}
STEPS=${STEPS:-calibrate tune report}
SHAPES=${SHAPES:-qwen3_1gpu deepseek_1gpu mixtral_1gpu small_experts odd_dim}
shape_args=()
for s in $SHAPES; do shape_args+=(--shape "$s"); done
mkdir -p "$OUT" "$WORK/report"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/uniep-site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/uniep-site:$PWD
else
    export PYTHONPATH=$PWD
fi
python3 -c 'import torchtitan' 2>/dev/null || { echo "torchtitan is not importable: pip install torchtitan==0.2.2 or put its wheels in $WHEELS/"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  python3 -c 'import matplotlib; print("matplotlib", matplotlib.__version__)' 2>/dev/null || echo "matplotlib missing: no PNG plots"
  python3 -c 'import tqdm; print("tqdm", tqdm.__version__)' 2>/dev/null || echo "tqdm missing: no progress bar"
  git log -1 --format='commit %H %s' 2>/dev/null; } | tee "$WORK/summary.txt"

# Seconds a step may take: its cap, at most what is left of TOTAL_S less 20 s for packing.
budget() {
    local left=$((TOTAL_S - (SECONDS - START) - 20))
    [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}
status=0
CONSTANTS=()
for step in $STEPS; do
    left=$(budget 100000)
    if [ "$left" -lt 30 ]; then echo "== $step skipped: ${left}s left" | tee -a "$WORK/summary.txt"; continue; fi
    t0=$SECONDS
    case $step in
    calibrate)
        if python3 -c 'import titan_uniep.tuning.calibrate' 2>/dev/null; then
            timeout "$(budget "${CALIBRATE_S:-170}")" python3 -m titan_uniep.tuning.calibrate --out "$WORK/constants.json" ${CALIBRATE_ARGS:-} \
                > "$WORK/calibrate.log" 2>&1 || status=1
        else
            echo "titan_uniep.tuning.calibrate is not in this tree" > "$WORK/calibrate.log"
        fi
        tail -5 "$WORK/calibrate.log" ;;
    tune)
        [ -f "$WORK/constants.json" ] && CONSTANTS=(--constants "$WORK/constants.json")
        timeout "$(budget "${TUNE_S:-420}")" python3 -m titan_uniep.tools.tune "${shape_args[@]}" --top "${TOP:-3}" \
            --warmup "${WARMUP:-2}" --reps "${REPS:-5}" --rounds "${ROUNDS:-2}" --confirm-rounds "${CONFIRM_ROUNDS:-4}" ${CONSTANTS[@]+"${CONSTANTS[@]}"} \
            --cache "$WORK/tuning.json" --json-out "$WORK/tune.jsonl" > "$WORK/tune.log" 2>&1 || status=1
        grep -E "^==|^\||picked|entry:|BROKEN|Error|wrote|seconds" "$WORK/tune.log" | cut -c1-220 | tail -60 ;;
    report)
        [ -f "$WORK/constants.json" ] && CONSTANTS=(--constants "$WORK/constants.json")
        for bench in bench bench_backward; do
            timeout "$(budget "${REPORT_S:-100}")" python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
                -m "titan_uniep.tools.$bench" "${shape_args[@]}" --check --report "$WORK/report" \
                --tuned-cache "$WORK/tuning.json" ${CONSTANTS[@]+"${CONSTANTS[@]}"} --warmup "${WARMUP:-2}" --reps "${REPS:-5}" \
                --json-out "$WORK/$bench.jsonl" > "$WORK/$bench.log" 2>&1 || status=1
            grep -E "^\||CHECK FAILED|Error|Traceback" "$WORK/$bench.log" | cut -c1-300 | tail -20
        done ;;
    *) echo "unknown step $step (calibrate, tune, report)"; status=2 ;;
    esac
    echo "== $step: $((SECONDS - t0)) s, status so far $status" | tee -a "$WORK/summary.txt"
done
for f in tuning.json constants.json tune.log; do [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"; done
for f in forward.md backward.md; do [ -f "$WORK/report/$f" ] && cp "$WORK/report/$f" "$OUT/"; done
echo "total $((SECONDS - START)) s, status $status" >> "$WORK/summary.txt"
cp "$WORK/summary.txt" "$OUT/"
tar czf "$OUT/results.tar.gz" -C "$WORK" .
exit $status
