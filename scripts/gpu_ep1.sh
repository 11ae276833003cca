#!/usr/bin/env bash
# EP = 1 on ONE GPU, from the repository root of a clean clone: the op's GPU test
# (eager and torch.compile), then the NGPU=1 config pair trained eager and with
# [compile] enable = true, each UniEP run compared with its baseline.
# Logs and dump folders go to $OUT (default /tmp/uniep-gpu-ep1).
#
#   bash scripts/gpu_ep1.sh                  # everything (~10 minutes on one H200)
#   STEPS="train" bash scripts/gpu_ep1.sh    # a subset of: tests train
#   TRAIN_STEPS=50 bash scripts/gpu_ep1.sh
#
# The compiled runs: ./run_train.sh with --compile.enable (TorchTitan 0.2.2
# compiles every block's attention, norms, router and shared experts; it
# leaves MoE experts, UniEP's op included, uncompiled).
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/uniep-gpu-ep1}
TRAIN_STEPS=${TRAIN_STEPS:-20}
# bf16 training: UniEP and TorchTitan agree to rounding (bitwise equality with TorchTitan is no contract).
RTOL=${RTOL:-1e-2}
mkdir -p "$OUT"
python3 -c 'import torch; assert torch.cuda.is_available()' || { echo "no CUDA GPU"; exit 1; }
status=0
for step in ${STEPS:-tests train}; do
    case $step in
    tests)
        echo "== tests/gpu/test_gpu_op.py"
        timeout 600 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_op.py 2>&1 | tee "$OUT/tests.log" \
            | grep -E "^[0-9]\.|OK|passed|failed|Error"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    train)
        for mode in eager compile; do
            extra=()
            [ "$mode" = compile ] && extra=(--compile.enable)
            for run in baseline uniep; do
                echo "== qwen3_debug_moe_ep1_$run, $mode, $TRAIN_STEPS steps"
                NGPU=1 CONFIG_FILE=train_configs/qwen3_debug_moe_ep1_$run.toml timeout 900 ./run_train.sh \
                    --training.steps "$TRAIN_STEPS" --job.dump_folder "$OUT/${run}_$mode" "${extra[@]}" \
                    > "$OUT/${run}_$mode.log" 2>&1 || { status=1; tail -30 "$OUT/${run}_$mode.log"; }
            done
            python3 -m titan_uniep.tools.compare_loss "$OUT/baseline_$mode" "$OUT/uniep_$mode" --rtol "$RTOL" \
                --labels "baseline ($mode)" "uniep fused ($mode)" > "$OUT/compare_$mode.txt" 2>&1 || status=1
            tail -6 "$OUT/compare_$mode.txt"
        done ;;
    *) echo "unknown step $step (tests, train)"; exit 2 ;;
    esac
done
exit $status
