#!/usr/bin/env bash
# Everything replica checks on a GPU machine, in one run (device time is scarce): set up
# (tools/gpu_setup.sh), the GPU tests, then the GPU benchmarks. Logs and result tables
# go to ${OUT:-gpu-out}. Usage: tools/gpu_check.sh [tests|bench|all] [extra pytest args]
set -u -o pipefail
WHAT=${1:-all}; shift || true
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source tools/gpu_setup.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/device.txt"
rc=0
if [[ $WHAT == tests || $WHAT == all ]]; then
  SECONDS=0
  # The paths most worth the device time first; a run cut short by its limit still says the most.
  FILES=${GPU_TESTS:-"tests/test_transport_gpu.py tests/test_gpu_placement.py tests/test_gpu_failover.py
    tests/test_gpu_resilient.py tests/test_gpu_weights.py tests/test_ops.py"}
  python3 -m pytest -m gpu $FILES -p no:cacheprovider --timeout 300 -q -rfEs "$@" 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -v "^PASSED" | tail -60 || rc=1
  echo "gpu tests: ${SECONDS} s"
fi
if [[ $WHAT == bench || $WHAT == all ]]; then
  SECONDS=0
  python3 -m pytest -m gpu bench -p no:cacheprovider --benchmark-only --timeout 400 -q -rfEs "$@" 2>&1 \
    | tee "$OUT/gpu_bench.log" | grep -v "^test_\|^---\|^Name\|^Legend\|^  " | tail -30 || rc=1
  cat bench/results/*gpu*.md 2>/dev/null | tee "$OUT/gpu_results.md"
  echo "gpu benchmarks: ${SECONDS} s"
fi
exit $rc
