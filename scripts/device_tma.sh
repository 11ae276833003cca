#!/usr/bin/env bash
# One device call (2 GPUs): fc2 / dA operands through tensor descriptors (KernelConfig.fc2_tma,
# BACKWARD_TILES["da_tma"]): the GPU tests (descriptor loads == pointer loads bitwise), then the
# probe of both against pointer loads on the three shapes (alternating order on qwen3-like).
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts
DIST="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_simulated.py tests/gpu/test_gpu_backward.py > /tmp/gpu.log 2>&1; echo "gpu tests exit $?"; tail -1 /tmp/gpu.log; grep -E "^FAILED|Error" /tmp/gpu.log | head -8
probe() { timeout $1 $DIST scripts/probe_combine.py --shape $2 --forward "$3" --backward "$4" > /tmp/p_$2.log 2>&1; echo "probe $2 exit $?"; }
probe 150 qwen3 '[{}, {"fc2_tma": true}, {}, {"fc2_tma": true}]' '[{}, {"da_tma": true}, {}, {"da_tma": true}]'
probe 120 deepseek '[{"fc2_tma": true}, {}]' '[{"da_tma": true}, {}]'
probe 120 mixtral '[{"fc2_tma": true}, {}]' '[{"da_tma": true}, {}]'
python3 - <<'PY'
import json
for s in ("qwen3", "deepseek", "mixtral"):
    for line in open(f"/tmp/p_{s}.log"):
        if not line.startswith("PROBE"):
            if "rror" in line: print(line[:300])
            continue
        r = json.loads(line[6:])
        ks = lambda key: [(n[:14], t) for n, t in r.get(key, []) if t >= 0.05]
        print(s, r.get("forward", r.get("backward")), r.get("fused_ms"), r.get("sequential_ms"),
              r.get("bitwise_fused_eq_sequential"), r.get("equals_first_variant"), r.get("error"))
        print("   F", ks("kernels_fused"))
        print("   S", ks("kernels_sequential"))
PY
