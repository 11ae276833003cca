#!/usr/bin/env bash
# Training-side GPU checks of the backward, in two device calls (repo root, 2 GPUs):
#   PART=A: fwd+bwd benchmark (qwen3-, deepseek-, mixtral-like) and the qwen3
#           30B-A3B-4L training throughput, baseline vs UniEP fused;
#   PART=B: deepseek_v3 debug model, 100 steps: baseline, UniEP sequential and
#           fused (bitwise), fused under AC full / selective (bitwise to no AC),
#           memory flat over the 100 steps in all three AC modes, and fused
#           with torch.compile of the model.
# Logs and runs go to $WORK, packed into $OUT/issue4_$PART.tgz at the end.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
RESULTS=${OUT:-/tmp/uniep-out}
export OUT=${WORK:-/tmp/uniep-work}
PART=${PART:-A}
mkdir -p "$OUT" "$RESULTS"
trap 'tar czf "$RESULTS/issue4_$PART.tgz" -C "$OUT" . 2>/dev/null' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS

train() {  # name config steps extra-args...
    local name=$1 cfg=$2 steps=$3; shift 3
    local t=$SECONDS
    NGPU=2 CONFIG_FILE=train_configs/$cfg.toml timeout "${RUN_S:-120}" ./run_train.sh --training.steps "$steps" \
        --job.dump_folder "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
    echo "train $name exit $? in $((SECONDS - t)) s; last: $(grep -a 'step:' "$OUT/$name.log" | tail -1 | sed 's/.*step:/step:/')"
    grep -a -E "Error|Traceback" "$OUT/$name.log" | head -5
}

if [ "$PART" = A ]; then
    timeout 300 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m titan_uniep.bench_backward \
        --shapes qwen3,deepseek,mixtral --check --warmup 2 --reps 5 --json-out "$OUT/bwd_bench.jsonl" \
        > "$OUT/bwd_bench.log" 2>&1; echo "bench_backward exit $?"
    grep -a -E "^\||JSON|Error|Traceback|failed" "$OUT/bwd_bench.log" | cut -c1-1200
    train q-base qwen3_30b_a3b_4l_baseline 20
    train q-fused qwen3_30b_a3b_4l_uniep 20 --uniep.schedule fused
    for run in q-base q-fused; do
        echo "$run median tps after step 4: $(grep -a -o 'tps: *[0-9,]*' "$OUT/$run.log" | tail -n +5 | tr -d ', tps:' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')"
        grep -a 'step: *20 ' "$OUT/$run.log" | sed 's/.*step:/step:/'
    done
    python3 -m titan_uniep.compare_loss "$OUT/q-base" "$OUT/q-fused" --rtol 2e-2 | tail -2
else
    S=${STEPS:-100}
    train d-base deepseek_v3_debug_baseline "$S"
    train d-seq deepseek_v3_debug_uniep "$S" --uniep.schedule sequential
    train d-fused deepseek_v3_debug_uniep "$S" --uniep.schedule fused
    for ac in full selective; do
        train "d-fused-ac$ac" deepseek_v3_debug_uniep "$S" --uniep.schedule fused --activation_checkpoint.mode $ac
    done
    train d-fused-compile deepseek_v3_debug_uniep 20 --uniep.schedule fused --compile.enable
    echo "== fused vs sequential"; python3 -m titan_uniep.compare_loss "$OUT/d-seq" "$OUT/d-fused" --assert-bitwise | tail -1
    for ac in full selective; do
        echo "== AC $ac vs none"; python3 -m titan_uniep.compare_loss "$OUT/d-fused" "$OUT/d-fused-ac$ac" --assert-bitwise | tail -1
    done
    echo "== baseline vs fused"; python3 -m titan_uniep.compare_loss "$OUT/d-base" "$OUT/d-fused" --rtol 2e-2 | tail -3
    echo "== compile vs eager (20 steps)"; python3 -m titan_uniep.compare_loss "$OUT/d-fused" "$OUT/d-fused-compile" --max-step 20 --rtol 1e-2 | tail -2
    for run in d-fused d-fused-acfull d-fused-acselective d-base; do
        python3 -m titan_uniep.memory_flat "$OUT/$run" --skip 5
    done
fi
echo "== total $((SECONDS - t0)) s"
