#!/usr/bin/env bash
# One device call (repo root, 2 GPUs) after a backward change: the real 2-GPU backward
# worker (recompute and saved h1|h3 paths, no host sync), the fwd+bwd benchmark on
# three shapes, and the custom op in TorchTitan training (qwen3 30B-A3B-4L throughput;
# deepseek_v3 debug fused vs sequential bitwise, memory flat). Logs: $OUT/run.tgz.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
W=/tmp/w; mkdir -p $W; trap 'tar czf $OUT/run.tgz -C $W . 2>/dev/null' EXIT
timeout 90 python3 -m torch.distributed.run --standalone --nproc_per_node 2 tests/gpu/ep_backward_worker.py > $W/ep.log 2>&1; echo "ep exit $?"
grep -E "saved_h13|no host sync: FAIL|ALL PASS|FAILURES|Error" $W/ep.log | head -12
timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m titan_uniep.bench_backward --shapes qwen3,deepseek,mixtral --check --warmup 2 --reps 5 > $W/bench.log 2>&1; echo "bench exit $?"
grep -E "^\||JSON|Error|Traceback|failed" $W/bench.log | cut -c1-1500
train() { local name=$1 cfg=$2 steps=$3; shift 3; NGPU=2 CONFIG_FILE=train_configs/$cfg.toml timeout 75 ./run_train.sh --training.steps $steps --job.dump_folder $W/$name "$@" > $W/$name.log 2>&1; echo "train $name exit $?: $(grep -a 'step:' $W/$name.log | tail -1 | sed 's/.*step:/step:/')"; grep -a -E "Error|Traceback" $W/$name.log | head -3; }
train q-fused qwen3_30b_a3b_4l_uniep 20 --uniep.schedule fused
echo "q-fused median tps after step 4: $(grep -a -o 'tps: *[0-9,]*' $W/q-fused.log | tail -n +5 | tr -d ', tps:' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')"
train d-seq deepseek_v3_debug_uniep 30 --uniep.schedule sequential
train d-fused deepseek_v3_debug_uniep 30 --uniep.schedule fused
python3 -m titan_uniep.compare_loss $W/d-seq $W/d-fused --assert-bitwise | tail -1
python3 -m titan_uniep.memory_flat $W/d-fused --skip 5 | tail -3
train d-compile deepseek_v3_debug_uniep 10 --uniep.schedule fused --compile.enable
python3 -m titan_uniep.compare_loss $W/d-fused $W/d-compile --max-step 10 --rtol 2e-2 | tail -2
