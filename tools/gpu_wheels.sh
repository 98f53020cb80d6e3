#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with the cp312 wheels that a GPU machine without a package
# registry needs for one kind of check, to carry in one device call (64 MiB a call, the
# checkout included): tools/gpu_setup.sh installs whatever .whl/ holds.
# Usage: tools/gpu_wheels.sh base|nixl
#   base: ucxx-cu13 and what it needs (the UCX transport's GPU tests, tools/gpu_check.sh), and
#         torchdata (tests/test_gpu_real_job.py; the image has transformers)
#   nixl: NIXL for CUDA 13 (tests/test_transport_gpu.py's NIXL cases, on device memory), its
#         expert-parallel extension (nixl_ep, 3 x 31 MB, which replica does not use) left out
set -eu -o pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
what=${1:?usage: tools/gpu_wheels.sh base|nixl}
rm -rf .whl && mkdir .whl
get() { $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$@"; }
case $what in
  base) get ucxx-cu13 libucxx-cu13 "libucx-cu13<1.22" rapids-logger rmm-cu13 librmm-cu13 nvtx expecttest torchdata==0.11.0 ;;
  nixl)
    get nixl==1.5.1 nixl-cu13==1.5.1
    $PY - .whl/nixl_cu13-*.whl <<'PY'
import os, sys, zipfile
path = sys.argv[1]
slim = path + ".slim"
with zipfile.ZipFile(path) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if item.filename.startswith("nixl_ep_"):
            continue
        data = src.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(True) if not l.startswith(b"nixl_ep_"))
        dst.writestr(item, data)
os.replace(slim, path)
PY
    ;;
  *) echo "tools/gpu_wheels.sh: no set '$what' (base, nixl)" >&2; exit 2 ;;
esac
du -sh .whl; ls .whl
