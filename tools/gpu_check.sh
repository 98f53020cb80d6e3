#!/usr/bin/env bash
# Everything replica checks on a GPU machine, in one run (device time is scarce): set up
# (tools/gpu_setup.sh), then phases in order of value -- kernels, the pack benchmark, an ncu
# profile of the pack kernels, the GPU tests, the GPU mirror and weight-sync benchmarks --
# each cut to what is left of BUDGET seconds (default 540), so a run that runs out still
# says the most. Logs go to /tmp/gpu-logs and, packed, to ${OUT:-gpu-out}/logs.tgz beside the
# result tables (so the logs come back as one file).
# Usage: tools/gpu_check.sh [tests|bench|all|overlap|nixl|selftest] [extra pytest args]
# selftest: `replica selftest --device cuda --quick` at world size 1 (the table in $OUT/selftest.md),
# the Hugging Face case, then the failover GPU tests in what is left.
# nixl: NIXL on device memory (tests/test_transport_gpu.py's nixl cases), after
# `tools/gpu_wheels.sh nixl` here and with .whl carried (the base wheels do not fit beside it).
# overlap: the mirror-beside-the-step checks first (tests/test_gpu_overlap.py, the transport's
# GPU tests, the mirror and weight-sync benchmarks), then the other GPU tests in what is left.
set -u -o pipefail
WHAT=${1:-all}; shift || true
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-540}
export PYTHONUNBUFFERED=1
START=$SECONDS
L=/tmp/gpu-logs; mkdir -p $L
finish() { cp bench/results/*gpu*.json bench/results/*gpu*.md "$OUT"/ 2>/dev/null; tar czf "$OUT/logs.tgz" -C /tmp gpu-logs
  [[ -n ${KEEP_BUILD:-} ]] && tar czf "$OUT/build.tgz" replica/_C*.so 2>/dev/null; }
trap finish EXIT
left() { echo $(( BUDGET - (SECONDS - START) )); }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $L/device.txt
source tools/gpu_setup.sh > $L/setup.log 2>&1 || { tail -60 $L/setup.log; exit 1; }
tail -1 $L/setup.log
P="python3 -X faulthandler -m pytest -p no:cacheprovider -q -rfEs --tb=short"
rc=0
phase() {  # name seconds-wanted command...
  local n=$1 want=$2; shift 2
  local l; l=$(left)
  (( l < 20 )) && { echo "== skip $n (${l} s left)"; rc=1; return; }
  (( want > l - 5 )) && want=$((l - 5))
  local S=$SECONDS; timeout $want "$@" > $L/$n.log 2>&1; local r=$?
  (( r == 0 )) || rc=1
  echo "== $n rc=$r $((SECONDS - S)) s: $(tail -1 $L/$n.log)"; grep -E "^(FAILED|ERROR)" $L/$n.log | head -8
}
if [[ $WHAT == overlap ]]; then
  phase overlap 150 $P -m gpu tests/test_gpu_overlap.py --timeout 140 "$@"
  phase transport_gpu 200 $P -m gpu tests/test_transport_gpu.py --timeout 120 "$@"
  phase bench_mirror 240 $P -m gpu bench/test_gpu_mirror.py --benchmark-only --timeout 230 "$@"
  grep -E "^\| |^Snapshot" bench/results/mirror_gpu.md 2>/dev/null
  phase bench_weights 120 $P -m gpu bench/test_gpu_weight_sync.py --benchmark-only --timeout 110 "$@"
  grep -E "^\| " bench/results/weight_sync_gpu.md 2>/dev/null
  for f in tests/test_gpu_failover.py tests/test_gpu_real_job.py tests/test_gpu_placement.py tests/test_gpu_weights.py; do
    phase "$(basename $f .py)" 200 $P -m gpu $f --timeout 150 "$@"
  done
fi
if [[ $WHAT == selftest ]]; then
  ST="python3 -m replica.roles.cli selftest --device cuda --trainers 1"
  phase selftest 240 $ST --quick --report $L/selftest
  sed -n '/^| case/,$p' $L/selftest.log
  cp $L/selftest/selftest.md "$OUT"/selftest.md 2>/dev/null
  phase selftest_hf 150 $ST --case hf-optimizer --case trainer-commit --case trainer-mirror --report $L/selftest-more
  sed -n '/^| case/,$p' $L/selftest_hf.log
  cp $L/selftest-more/selftest.md "$OUT"/selftest-more.md 2>/dev/null
  for f in tests/test_gpu_failover.py tests/test_gpu_real_job.py tests/test_gpu_overlap.py; do
    phase "$(basename $f .py)" 150 $P -m gpu $f --timeout 140 "$@"
  done
fi
if [[ $WHAT == nixl ]]; then
  python3 -c "import nixl" 2>/dev/null || { echo "NIXL is not installed: tools/gpu_wheels.sh nixl, carry .whl"; exit 1; }
  phase nixl_gpu 400 $P -m gpu tests/test_transport_gpu.py -k nixl --timeout 150 "$@"
fi
if [[ $WHAT == tests || $WHAT == all ]]; then
  phase ops 90 $P -m gpu tests/test_ops.py tests/test_pack_checksum.py --timeout 60 "$@"
fi
if [[ $WHAT == bench || $WHAT == all ]]; then
  phase bench_pack 90 $P -m gpu bench/test_pack.py --benchmark-only --timeout 80 "$@"
  grep -E "^\| " bench/results/pack_gpu.md
  for case in large small; do
    phase ncu_$case 45 ncu --clock-control none --kernel-name regex:"pack_checksum_kernel|copy_tiles_kernel|checksum_partial" \
      --launch-skip 3 --launch-count 3 --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      python3 tools/ncu_pack.py $case
    grep -E "_kernel|Duration|DRAM Throughput|Compute \(SM\)|Theoretical Occ|Achieved Occ|Registers Per|Warp Cycles Per Issued|Issued Warp Per" \
      $L/ncu_$case.log | head -40
  done
fi
if [[ $WHAT == tests || $WHAT == all ]]; then
  for f in ${GPU_TESTS:-tests/test_gpu_overlap.py tests/test_gpu_failover.py tests/test_gpu_real_job.py
      tests/test_gpu_weights.py tests/test_gpu_resilient.py tests/test_gpu_placement.py tests/test_transport_gpu.py}; do
    phase "$(basename $f .py)" 300 $P -m gpu $f --timeout 150 "$@"
  done
fi
if [[ $WHAT == bench || $WHAT == all ]]; then
  phase bench_mirror 200 $P -m gpu bench/test_gpu_mirror.py --benchmark-only --timeout 190 "$@"
  grep -E "^\| " bench/results/mirror_gpu.md 2>/dev/null
  phase bench_weights 150 $P -m gpu bench/test_gpu_weight_sync.py --benchmark-only --timeout 140 "$@"
fi
echo "total $((SECONDS - START)) s"
exit $rc
