#!/usr/bin/env bash
# One GPU test file (or node ids) per pytest process, each log kept, so a crash in one
# loses nothing of the others. Usage: tools/gpu_diag.sh NAME "PYTEST ARGS" [NAME "ARGS"]...
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source tools/gpu_setup.sh || exit 1
while (($# >= 2)); do
  name=$1 args=$2; shift 2
  SECONDS=0
  python3 -X faulthandler -m pytest -p no:cacheprovider --timeout 300 -q -rfE --tb=short $args > "$OUT/$name.log" 2>&1
  echo "== $name: rc=$? ${SECONDS}s: $(tail -1 "$OUT/$name.log")"
done
