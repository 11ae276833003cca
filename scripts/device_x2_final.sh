#!/usr/bin/env bash
# One short device call (2 GPUs): the real 2-GPU workers (bitwise, local_first included), the qwen3-like
# forward and forward + backward benches with --check, then the local_first A/B (probe_combine.py).
# Every part writes its log under $OUT as it goes, so a call cut short still returns what ran.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts
DIST="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
O=${OUT:-/tmp}
UNIEP_EP_COMBINES=direct,local_first timeout 60 $DIST tests/gpu/ep_worker.py > $O/epf.log 2>&1
echo "ep forward exit $?: $(grep -c PASS $O/epf.log) PASS"; grep -E "FAIL|Error" $O/epf.log | head -5
timeout 60 $DIST tests/gpu/ep_backward_worker.py > $O/epb.log 2>&1
echo "ep backward exit $?: $(grep -c PASS $O/epb.log) PASS"; grep -E "FAIL|Error" $O/epb.log | head -5
timeout 45 $DIST -m titan_uniep.bench --shapes qwen3 --check --warmup 3 --reps 10 > $O/fwd.log 2>&1
echo "fwd exit $?"; grep -E "^\|" $O/fwd.log; grep -o '"check_fused_equals_sequential": [a-z]*' $O/fwd.log
timeout 60 $DIST -m titan_uniep.bench_backward --shapes qwen3 --check --warmup 2 --reps 10 > $O/bwd.log 2>&1
echo "bwd exit $?"; grep -E "^\|" $O/bwd.log; grep -o '"bitwise_fused_eq_sequential": [a-z]*' $O/bwd.log
LF='{"local_first": true, "num_comm_sms": 32}'
timeout 80 $DIST scripts/probe_combine.py --shape qwen3 --warmup 2 --reps 5 --forward "[{}, $LF, {}, $LF]" \
    --backward "[{}, {\"_config\": $LF}]" > $O/probe.log 2>&1
echo "probe exit $?"; grep -E "PROBE|Error" $O/probe.log | cut -c1-400 | head -12
