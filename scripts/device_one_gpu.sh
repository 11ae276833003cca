#!/usr/bin/env bash
# One-GPU device call (nvidia-h200, repo root): the backward GPU tests (simulated worlds) and the
# backward (or, PROBE=probe_forward_variants, forward) variant probe on simulated EP=2 worlds.
#   VARIANTS: JSON list of BACKWARD_TILES overrides (forward: KernelConfig changes), the first one the
#   reference; SHAPES: probe shapes, each "name" or "name:T" (T tokens per rank, where two ranks'
#   buffers at the shape's T do not fit one GPU); TESTS=0 skips the tests, TESTS_K selects some.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
[ "${TESTS:-1}" = 1 ] && timeout 300 python3 -m pytest -q -p no:cacheprovider ${TEST_FILES:-tests/gpu/test_gpu_backward.py} \
  ${TESTS_K:+-k "$TESTS_K"} 2>&1 | grep -E "passed|failed|^FAILED|Error" | head -12
DEFAULT_VARIANTS='[{}, {"dh_copies_rows": true}]'
PROBE=${PROBE:-probe_backward_variants}
for shape in ${SHAPES:-qwen3}; do
  tokens=""; [[ $shape == *:* ]] && tokens="--tokens ${shape#*:}"
  timeout 200 python3 scripts/$PROBE.py --shape ${shape%:*} $tokens --rounds ${ROUNDS:-2} \
    --variants "${VARIANTS:-$DEFAULT_VARIANTS}" 2>&1 | grep -v Warning
done
