#!/usr/bin/env bash
# TorchTitan training on the 2-GPU machine: baseline vs UniEP (reference,
# sequential, fused), loss comparisons, all logs under $OUT.
# Usage (repo root): bash scripts/device_train.sh   [STEPS=50 MODELS="deepseek_v3_debug qwen3_debug_moe"]
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/uniep-out}
mkdir -p "$OUT"
if ls .gpu-wheels/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/torchtitan ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD || export PYTHONPATH=$PWD
STEPS=${STEPS:-50}
RUN_S=${RUN_S:-150}

train() {  # name config extra-args...
    local name=$1 cfg=$2; shift 2
    local t0=$SECONDS
    NGPU=2 CONFIG_FILE=train_configs/$cfg.toml timeout "$RUN_S" ./run_train.sh --training.steps "$STEPS" \
        --job.dump_folder "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
    echo "train $name exit $? in $((SECONDS - t0)) s; last: $(grep -a 'step:' "$OUT/$name.log" | tail -1 | sed 's/.*step:/step:/')"
    grep -a -E "Error|Traceback" "$OUT/$name.log" | head -5
}

for model in ${MODELS:-deepseek_v3_debug qwen3_debug_moe}; do
    base=${model}_baseline uni=${model}_uniep
    [ -f train_configs/$base.toml ] || base=${model}_moe_baseline
    train "$model-base" "$base"
    for sched in ${SCHEDULES:-reference sequential fused}; do
        train "$model-$sched" "$uni" --uniep.schedule "$sched"
    done
    for sched in ${SCHEDULES:-reference sequential fused}; do
        echo "== $model: baseline vs UniEP $sched"
        python3 -m titan_uniep.compare_loss "$OUT/$model-base" "$OUT/$model-$sched" --rtol 2e-2 | tail -3
    done
    if [ -d "$OUT/$model-sequential" ] && [ -d "$OUT/$model-fused" ]; then
        echo "== $model: fused vs sequential (bitwise)"
        python3 -m titan_uniep.compare_loss "$OUT/$model-sequential" "$OUT/$model-fused" --assert-bitwise | tail -2
    fi
done
