#!/usr/bin/env bash
# Device calls (repo root, 2 GPUs) for the weight-gradient launches (kernels/wgrad.py).
# PART=A: GPU backward tests (both wgrad backends), the real 2-GPU backward worker,
#         the fwd+bwd benchmark on three shapes (--check, the Triton backend as a sweep, --profile).
# PART=B: TorchTitan training with the custom op: qwen3 30B-A3B-4L fused vs baseline throughput,
#         deepseek_v3 debug fused vs sequential bitwise (50 steps) + memory flat, AC full and
#         selective bitwise equal to no AC (30 steps: a different LR schedule than the 50-step run,
#         so only steps 1-8 compare; PART=C repeats it at 50 steps).
# PART=C: see below.
# Logs: $OUT/run.tgz.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
W=/tmp/w; mkdir -p $W; trap 'tar czf $OUT/run.tgz -C $W . 2>/dev/null' EXIT
if [ "${PART:-A}" = A ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_backward.py > $W/gpu_tests.log 2>&1; echo "gpu tests exit $?"; tail -3 $W/gpu_tests.log; grep -E "^FAILED|Error" $W/gpu_tests.log | head -8
  timeout 90 python3 -m torch.distributed.run --standalone --nproc_per_node 2 tests/gpu/ep_backward_worker.py > $W/ep.log 2>&1; echo "ep exit $?"
  grep -E "saved_h13|no host sync|ALL PASS|FAILURES|Error" $W/ep.log | head -12
  timeout 280 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m titan_uniep.bench_backward --shapes qwen3,deepseek,mixtral --check --warmup 2 --reps 5 --sweep-tiles '[{"wgrad": "triton"}, {"dh_programs_per_sm": 1}]' --profile > $W/bench.log 2>&1; echo "bench exit $?"
  grep -E "^\||JSON|Error|Traceback|failed|wgrad|gather|grouped|Kernel|kernel" $W/bench.log | cut -c1-600 | head -150
elif [ "${PART}" = C ]; then
  # AC full / selective against no AC at the same step count (the LR schedule depends on it),
  # the forward's kernel profile on qwen3-like shapes, and dA tile widths on qwen3-like shapes.
  train() { local name=$1 cfg=$2 steps=$3; shift 3; NGPU=2 CONFIG_FILE=train_configs/$cfg.toml timeout ${TT:-75} ./run_train.sh --training.steps $steps --job.dump_folder $W/$name "$@" > $W/$name.log 2>&1; echo "train $name exit $?: $(grep -a 'step:' $W/$name.log | tail -1 | sed 's/.*step:/step:/')"; grep -a -E "Error|Traceback" $W/$name.log | head -3; }
  TT=70 train d-fused deepseek_v3_debug_uniep 50 --uniep.schedule fused
  for ac in full selective; do
    TT=70 train d-fused-ac$ac deepseek_v3_debug_uniep 50 --uniep.schedule fused --activation_checkpoint.mode $ac
    echo "== AC $ac vs none"; python3 -m titan_uniep.compare_loss $W/d-fused $W/d-fused-ac$ac --assert-bitwise | tail -1
    python3 -m titan_uniep.memory_flat $W/d-fused-ac$ac --skip 5 | tail -1
  done
  timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m titan_uniep.bench --shapes qwen3 --warmup 3 --reps 10 --profile > $W/fwd.log 2>&1; echo "fwd bench exit $?"
  grep -E "^\|" $W/fwd.log | head -8; grep -A18 "^PROFILE" $W/fwd.log | cut -c1-150
  timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m titan_uniep.bench_backward --shapes qwen3 --warmup 2 --reps 8 --sweep-tiles '[{"da": 256}, {"da": 64}]' > $W/bwd.log 2>&1; echo "bwd bench exit $?"
  grep -E "JSON|Error" $W/bwd.log | cut -c1-900
else
  train() { local name=$1 cfg=$2 steps=$3; shift 3; NGPU=2 CONFIG_FILE=train_configs/$cfg.toml timeout ${TT:-75} ./run_train.sh --training.steps $steps --job.dump_folder $W/$name "$@" > $W/$name.log 2>&1; echo "train $name exit $?: $(grep -a 'step:' $W/$name.log | tail -1 | sed 's/.*step:/step:/')"; grep -a -E "Error|Traceback" $W/$name.log | head -3; }
  train q-fused qwen3_30b_a3b_4l_uniep 20 --uniep.schedule fused
  echo "q-fused median tps after step 4: $(grep -a -o 'tps: *[0-9,]*' $W/q-fused.log | tail -n +5 | tr -d ', tps:' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')"
  train q-base qwen3_30b_a3b_4l_baseline 20
  echo "q-base median tps after step 4: $(grep -a -o 'tps: *[0-9,]*' $W/q-base.log | tail -n +5 | tr -d ', tps:' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')"
  python3 -m titan_uniep.compare_loss $W/q-base $W/q-fused --rtol 2e-2 | tail -2
  TT=80 train d-seq deepseek_v3_debug_uniep 50 --uniep.schedule sequential
  TT=80 train d-fused deepseek_v3_debug_uniep 50 --uniep.schedule fused
  python3 -m titan_uniep.compare_loss $W/d-seq $W/d-fused --assert-bitwise | tail -1
  python3 -m titan_uniep.memory_flat $W/d-fused --skip 5 | tail -3
  for ac in full selective; do
    TT=60 train d-fused-ac$ac deepseek_v3_debug_uniep 30 --uniep.schedule fused --activation_checkpoint.mode $ac
    echo "== AC $ac vs none"; python3 -m titan_uniep.compare_loss $W/d-fused $W/d-fused-ac$ac --max-step 30 --assert-bitwise | tail -1
    python3 -m titan_uniep.memory_flat $W/d-fused-ac$ac --skip 5 | tail -1
  done
fi
