#!/usr/bin/env bash
# One device call for an integrated change: the kernels' GPU tests, then
# TorchTitan training baseline vs UniEP (reference / sequential / fused, AC
# variants) with loss comparisons. Logs under $OUT. Repo root, 2 GPUs.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# Logs and runs go to $WORK; the end packs them into $OUT/device_final.tgz
# (the device tool returns few files).
RESULTS=${OUT:-/tmp/uniep-out}
export OUT=${WORK:-/tmp/uniep-work}
mkdir -p "$OUT" "$RESULTS"
trap 'tar czf "$RESULTS/device_final.tgz" -C "$OUT" . 2>/dev/null' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl
export PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS
if [ -n "${WITH_SIM:-}" ]; then
    echo "== kernels: simulated world on one GPU (forward, backward)"
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_simulated.py tests/gpu/test_gpu_backward.py \
        > "$OUT/gpu_sim.log" 2>&1; echo "exit $?"; tail -3 "$OUT/gpu_sim.log"
fi
echo "== kernels: real EP on 2 GPUs (forward: no-sync, graph replay, timeout; backward)"
timeout 100 python3 -m torch.distributed.run --standalone --nproc_per_node 2 tests/gpu/ep_worker.py > "$OUT/ep.log" 2>&1
echo "ep_worker exit $?"; grep -a -E "PASS|FAIL|OK|Error|Traceback" "$OUT/ep.log" | head -20
if [ -n "${WITH_BWD_WORKER:-}" ]; then
    timeout 100 python3 -m torch.distributed.run --standalone --nproc_per_node 2 tests/gpu/ep_backward_worker.py > "$OUT/ep_bwd.log" 2>&1
    echo "ep_backward_worker exit $?"; grep -a -E "PASS|FAIL|Error|Traceback" "$OUT/ep_bwd.log" | head -20
fi
echo "== kernels took $((SECONDS - t0)) s"
STEPS=${STEPS:-30} MODELS="deepseek_v3_debug" SCHEDULES="reference sequential fused" bash scripts/device_train.sh
STEPS=${STEPS_BIG:-20} MODELS="qwen3_30b_a3b_4l" SCHEDULES="sequential fused" bash scripts/device_train.sh
grep -a -h "step: *${STEPS_BIG:-20} " "$OUT"/qwen3_30b_a3b_4l-*.log | sed 's/.*step:/step:/'
for ac in full selective; do
    NGPU=2 CONFIG_FILE=train_configs/deepseek_v3_debug_uniep.toml timeout 150 ./run_train.sh --training.steps "${STEPS:-30}" \
        --uniep.schedule fused --activation_checkpoint.mode $ac --job.dump_folder "$OUT/deepseek_v3_debug-fused-ac$ac" \
        > "$OUT/deepseek_v3_debug-fused-ac$ac.log" 2>&1; echo "fused AC $ac exit $?"
    python3 -m titan_uniep.compare_loss "$OUT/deepseek_v3_debug-fused" "$OUT/deepseek_v3_debug-fused-ac$ac" --assert-bitwise | tail -1
done
echo "== total $((SECONDS - t0)) s"
