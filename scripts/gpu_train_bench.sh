#!/usr/bin/env bash
# Training on GPUs as users run it, from the repository root of a clean clone:
# TorchTitan's baseline against UniEP with titan_uniep.tools.bench_train (alternating
# runs, deterministic off), and the long runs that check the loss against the
# baseline and the bits of the schedules and of a tuned point. Results go to
# $OUT/<step>/ (default /tmp/uniep-train).
#
#   bash scripts/gpu_train_bench.sh                          # qwen3 and deepseek, eager
#   STEPS="qwen3_compile qwen3_sac" bash scripts/gpu_train_bench.sh
#   NGPU=2 OVERRIDES="--parallelism.expert_parallel_degree 2" bash scripts/gpu_train_bench.sh
#
# Steps:
#   qwen3, deepseek   the qwen3 30B-A3B-4L / DeepSeek-V3-16B-4L pair, eager
#   qwen3_compile     the qwen3 pair with --compile.enable
#   qwen3_sac         the qwen3 pair with activation_checkpoint.mode = "selective"
#   profile           the qwen3 pair, one run a side with TorchTitan's profiler at step 13 (not a logged step at
#                     log_freq 10): GPU time by kernel, where the GPU waits for the host, where the host's time goes
#   long              the qwen3 pair for $LONG_STEPS steps (deterministic on, every step logged): UniEP fused
#                     against the baseline (relative loss difference), fused against sequential (bitwise), and
#                     the baseline against its own run with deterministic off (the spread to read that against)
#   seeds             the long step's comparisons at other initialisations: per seed in $SEEDS (default
#                     "11 23 42"), $LONG_STEPS steps of the baseline (deterministic on), of the baseline with
#                     deterministic off and of UniEP fused, each compared with the first: how far TorchTitan's
#                     runs differ from each other, and UniEP from TorchTitan, over several draws
#   tuned             titan_uniep.tools.tune --config on the qwen3 UniEP config, then $LONG_STEPS steps with
#                     [uniep] tuning = "cached" against the default point's fused run (bitwise)
#   memory            the DeepSeek pair ($MEMORY_PAIR: qwen3 for the other), one run a side of 3 steps with
#                     TorchTitan's memory snapshot after step 2: how each side's caching allocator filled its
#                     segments (reserved, allocated, free between blocks), and its largest segments
#
# TorchTitan and its pure-Python dependencies: installed already, or as wheels
# in $WHEELS (default .gpu-wheels/), installed into a scratch folder.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/uniep-train}
WHEELS=${WHEELS:-.gpu-wheels}
NGPU=${NGPU:-1}
BENCH_STEPS=${BENCH_STEPS:-50}
WARMUP=${WARMUP:-10}
RUNS=${RUNS:-2}
LONG_STEPS=${LONG_STEPS:-200}
read -r -a OVERRIDES <<< "${OVERRIDES:-}"
mkdir -p "$OUT"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/uniep-site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/uniep-site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c 'import torchtitan' 2>/dev/null || { echo "torchtitan is not importable: pip install torchtitan==0.2.2 or put its wheels in $WHEELS/"; exit 1; }
QWEN=(--baseline train_configs/qwen3_30b_a3b_4l_baseline.toml --uniep train_configs/qwen3_30b_a3b_4l_uniep.toml)
DEEPSEEK=(--baseline train_configs/deepseek_v3_16b_4l_baseline.toml --uniep train_configs/deepseek_v3_16b_4l_uniep.toml)

bench() {  # bench NAME [bench_train options]
    local name=$1
    shift
    echo "== bench_train $name"
    python3 -m titan_uniep.tools.bench_train --ngpu "$NGPU" --steps "$BENCH_STEPS" --warmup "$WARMUP" --runs "$RUNS" \
        --out "$OUT/$name" "$@" ${OVERRIDES[@]+-- "${OVERRIDES[@]}"} || status=1
}

train() {  # train CONFIG DUMP_FOLDER [overrides]: one run of $LONG_STEPS steps, deterministic on, every step logged
    local config=$1 dump=$2
    shift 2
    mkdir -p "$(dirname "$dump")"
    echo "== $(basename "$config") -> $dump $*"
    NGPU=$NGPU CONFIG_FILE=$config ./run_train.sh --training.steps "$LONG_STEPS" --debug.deterministic --metrics.log_freq 1 \
        --job.dump_folder "$dump" "${OVERRIDES[@]}" "$@" > "$dump.log" 2>&1 || { status=1; tail -30 "$dump.log"; }
}

status=0
for step in ${STEPS:-qwen3 deepseek}; do
    case $step in
    qwen3) bench qwen3 "${QWEN[@]}" ;;
    deepseek) bench deepseek "${DEEPSEEK[@]}" ;;
    qwen3_compile) bench qwen3_compile "${QWEN[@]}" --compile ;;
    qwen3_sac) bench qwen3_sac "${QWEN[@]}" --ac-mode selective ;;
    profile)
        for side in baseline uniep; do
            dump=$OUT/profile_$side
            NGPU=$NGPU CONFIG_FILE=train_configs/qwen3_30b_a3b_4l_$side.toml ./run_train.sh --training.steps 14 \
                --debug.no-deterministic --profiling.enable_profiling --profiling.profile_freq 13 \
                --job.dump_folder "$dump" "${OVERRIDES[@]}" > "$dump.log" 2>&1 || { status=1; tail -30 "$dump.log"; }
            python3 scripts/profile_summary.py "$dump"/profile_traces/iteration_13/rank0_trace.json \
                | tee "$OUT/profile_summary_$side.txt"
        done ;;
    long)
        mkdir -p "$OUT/long"
        train train_configs/qwen3_30b_a3b_4l_baseline.toml "$OUT/long/baseline"
        train train_configs/qwen3_30b_a3b_4l_uniep.toml "$OUT/long/fused"
        train train_configs/qwen3_30b_a3b_4l_uniep.toml "$OUT/long/sequential" --uniep.schedule sequential
        # TorchTitan against itself (deterministic off): the spread the UniEP difference is read against.
        train train_configs/qwen3_30b_a3b_4l_baseline.toml "$OUT/long/baseline_nondeterministic" --debug.no-deterministic
        python3 -m titan_uniep.tools.compare_loss "$OUT/long/baseline" "$OUT/long/baseline_nondeterministic" \
            --window 10 --labels baseline "baseline, deterministic off" | tail -5
        python3 -m titan_uniep.tools.compare_loss "$OUT/long/baseline" "$OUT/long/fused" --rtol 1e-2 --window 10 \
            --labels baseline "uniep fused" --plot "$OUT/long/fused_vs_baseline.png" | tail -10 || status=1
        python3 -m titan_uniep.tools.compare_loss "$OUT/long/sequential" "$OUT/long/fused" --assert-bitwise \
            --labels sequential fused --plot "$OUT/long/fused_vs_sequential.png" | tail -4 || status=1 ;;
    seeds)
        for seed in ${SEEDS:-11 23 42}; do
            dir=$OUT/seeds/seed$seed
            mkdir -p "$dir"
            train train_configs/qwen3_30b_a3b_4l_baseline.toml "$dir/baseline" --debug.seed "$seed"
            train train_configs/qwen3_30b_a3b_4l_baseline.toml "$dir/baseline_nondeterministic" --debug.seed "$seed" \
                --debug.no-deterministic
            train train_configs/qwen3_30b_a3b_4l_uniep.toml "$dir/fused" --debug.seed "$seed"
            echo "== seed $seed"
            for run in baseline_nondeterministic fused; do
                python3 -m titan_uniep.tools.compare_loss "$dir/baseline" "$dir/$run" --window 10 \
                    --labels baseline "$run" | tail -5 | grep -v "^plot:"
            done
        done ;;
    memory)
        stem=$([ "${MEMORY_PAIR:-deepseek}" = qwen3 ] && echo qwen3_30b_a3b_4l || echo deepseek_v3_16b_4l)
        for side in baseline uniep; do
            dump=$OUT/memory_$side
            NGPU=$NGPU CONFIG_FILE=train_configs/${stem}_$side.toml ./run_train.sh --training.steps 3 \
                --debug.no-deterministic --profiling.enable_memory_snapshot --profiling.profile_freq 2 \
                --job.dump_folder "$dump" "${OVERRIDES[@]}" > "$dump.log" 2>&1 || { status=1; tail -30 "$dump.log"; }
            echo "== $side: the caching allocator's segments after step 2"
            python3 - "$dump" <<'PY' | tee "$OUT/memory_segments_$side.txt"
import glob, pickle, sys
from torch.cuda._memory_viz import segsum
path = sorted(glob.glob(f"{sys.argv[1]}/**/iteration_2/rank0_memory_snapshot.pickle", recursive=True))[-1]
lines = segsum(pickle.load(open(path, "rb"))).splitlines()
summary = [line for line in lines if line.startswith(("segments:", "total_"))]
segments = [line for line in lines if line.startswith("[")]
print("\n".join(summary + ["largest segments:"] + [line.split("] ", 1)[1] for line in segments[-8:]]))
PY
        done ;;
    tuned)
        mkdir -p "$OUT/tuned"
        python3 -m titan_uniep.tools.tune --config train_configs/qwen3_30b_a3b_4l_uniep.toml --cache "$OUT/tuned/tuning.json" \
            --no-progress > "$OUT/tuned/tune.log" 2>&1 || { status=1; tail -30 "$OUT/tuned/tune.log"; }
        grep -E "^entry|searched in|refused|BITWISE" "$OUT/tuned/tune.log"
        [ -d "$OUT/long/fused" ] || train train_configs/qwen3_30b_a3b_4l_uniep.toml "$OUT/long/fused"
        train train_configs/qwen3_30b_a3b_4l_uniep.toml "$OUT/tuned/fused" --uniep.tuning cached \
            --uniep.tuning_cache "$OUT/tuned/tuning.json"
        grep -E "UniEP tuning|tuned point|cached" "$OUT/tuned/fused.log" | head -5
        python3 -m titan_uniep.tools.compare_loss "$OUT/long/fused" "$OUT/tuned/fused" --assert-bitwise \
            --labels default tuned --plot "$OUT/tuned/tuned_vs_default.png" | tail -4 || status=1 ;;
    *) echo "unknown step $step"; exit 2 ;;
    esac
done
exit $status
