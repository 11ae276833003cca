#!/usr/bin/env bash
# Device calls (repo root, 2 GPUs) for the two-programs-per-SM GEMM + combine kernels of
# short expert GEMMs (kernels.tuning.SHORT_FC2, fused_backward.BACKWARD_TILES["da_short"]).
# PART=A: GPU tests (simulated worlds), the real 2-GPU forward and backward workers, the forward
#         and forward + backward benchmarks on three shapes with --check.
# PART=B: TorchTitan training with the custom op: qwen3 30B-A3B-4L fused vs baseline (20 steps),
#         deepseek_v3 debug sequential vs fused (50 steps, bitwise) and memory flat.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
W=/tmp/w; mkdir -p $W; trap 'tar czf $OUT/run.tgz -C $W . 2>/dev/null' EXIT
DIST="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
if [ "${PART:-A}" = A ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_simulated.py tests/gpu/test_gpu_backward.py > $W/gpu_tests.log 2>&1; echo "gpu tests exit $?"; tail -1 $W/gpu_tests.log; grep -E "^FAILED|Error" $W/gpu_tests.log | head -8
  timeout 70 $DIST tests/gpu/ep_worker.py > $W/epf.log 2>&1; echo "ep forward exit $?: $(grep -c PASS $W/epf.log) PASS"; grep -E "FAIL|Error" $W/epf.log | head -5
  timeout 70 $DIST tests/gpu/ep_backward_worker.py > $W/epb.log 2>&1; echo "ep backward exit $?: $(grep -c PASS $W/epb.log) PASS"; grep -E "FAIL|Error" $W/epb.log | head -5
  timeout 80 $DIST -m titan_uniep.bench --shapes qwen3,deepseek,mixtral --check --warmup 3 --reps 10 > $W/fwd.log 2>&1; echo "fwd exit $?"
  grep -E "^\|" $W/fwd.log; grep -o '"check_fused_equals_sequential": [a-z]*' $W/fwd.log
  timeout 170 $DIST -m titan_uniep.bench_backward --shapes qwen3,deepseek,mixtral --check --warmup 2 --reps 5 > $W/bwd.log 2>&1; echo "bwd exit $?"
  grep -E "^\|" $W/bwd.log; grep -o '"bitwise_fused_eq_sequential": [a-z]*' $W/bwd.log; grep -E "Error|Traceback" $W/bwd.log | head -3
else
  train() { local name=$1 cfg=$2 steps=$3; shift 3; NGPU=2 CONFIG_FILE=train_configs/$cfg.toml timeout ${TT:-75} ./run_train.sh --training.steps $steps --job.dump_folder $W/$name "$@" > $W/$name.log 2>&1; echo "train $name exit $?: $(grep -a 'step:' $W/$name.log | tail -1 | sed 's/.*step:/step:/')"; grep -a -E "Error|Traceback" $W/$name.log | head -3; }
  tps() { grep -a -o 'tps: *[0-9,]*' $W/$1.log | tail -n +5 | tr -d ', tps:' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
  train q-fused qwen3_30b_a3b_4l_uniep 20 --uniep.schedule fused; echo "q-fused median tps after step 4: $(tps q-fused)"
  train q-base qwen3_30b_a3b_4l_baseline 20; echo "q-base median tps after step 4: $(tps q-base)"
  python3 -m titan_uniep.compare_loss $W/q-base $W/q-fused --rtol 2e-2 | tail -2
  TT=80 train d-seq deepseek_v3_debug_uniep 50 --uniep.schedule sequential
  TT=80 train d-fused deepseek_v3_debug_uniep 50 --uniep.schedule fused
  python3 -m titan_uniep.compare_loss $W/d-seq $W/d-fused --assert-bitwise | tail -1
  python3 -m titan_uniep.memory_flat $W/d-fused --skip 5 | tail -3
fi
