#!/usr/bin/env bash
# One device call (2 GPUs, nvidia-h200-x2): KernelConfig.local_first against the default, forward (A) and
# backward (BA), in alternating order (scripts/probe_combine.py), then the real 2-GPU workers (bitwise,
# local_first included) and the qwen3-like benches with the defaults.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts
DIST="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
LF='{"local_first": true, "num_comm_sms": 32}'
FWD=${FWD:-"[{}, $LF, {}, $LF, {\"local_first\": true, \"num_comm_sms\": 16}, {\"local_first\": true, \"num_comm_sms\": 32, \"local_first_experts\": 0.5}]"}
BWD=${BWD:-"[{}, {\"_config\": $LF}, {}, {\"_config\": $LF}, {\"_config\": {\"local_first\": true, \"num_comm_sms\": 16}}]"}
timeout ${T1:-300} $DIST scripts/probe_combine.py --shape ${SHAPE:-qwen3} --forward "$FWD" --backward "$BWD" > /tmp/probe.log 2>&1
echo "probe exit $?"
grep -E "PROBE|Error|error" /tmp/probe.log | head -40
if [ "${WORKERS:-1}" = 1 ]; then
  timeout 90 $DIST tests/gpu/ep_worker.py > /tmp/epf.log 2>&1; echo "ep forward exit $?: $(grep -c PASS /tmp/epf.log) PASS"; grep -E "FAIL|Error" /tmp/epf.log | head -5
  timeout 90 $DIST tests/gpu/ep_backward_worker.py > /tmp/epb.log 2>&1; echo "ep backward exit $?: $(grep -c PASS /tmp/epb.log) PASS"; grep -E "FAIL|Error" /tmp/epb.log | head -5
fi
if [ "${BENCH:-1}" = 1 ]; then
  timeout 60 $DIST -m titan_uniep.bench --shapes qwen3 --check --warmup 3 --reps 10 > /tmp/fwd.log 2>&1; echo "fwd exit $?"; grep -E "^\|" /tmp/fwd.log
  timeout 90 $DIST -m titan_uniep.bench_backward --shapes qwen3 --check --warmup 3 --reps 10 > /tmp/bwd.log 2>&1; echo "bwd exit $?"; grep -E "^\|" /tmp/bwd.log
fi
