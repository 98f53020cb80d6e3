#!/usr/bin/env bash
# Sets up a bare GPU machine (CUDA 13, its own torch, no registry) for replica's GPU checks:
# installs the wheels carried in .whl (ucxx-cu13 and what it needs; see README "GPU checks"),
# then builds replica._C in place for the local GPU. Source it: it exports PYTHONPATH.
set -u
PY=${PY:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1 2>/dev/null || exit 1
  export PYTHONPATH=/tmp/site:$PWD/tests:$PWD/examples${PYTHONPATH:+:$PYTHONPATH}
fi
# UCX from the wheel, not a system one; cuda_copy/cuda_ipc need the wheel's plugins.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$($PY -c "import torch; c=torch.cuda.get_device_capability(); print(f'{c[0]}.{c[1]}')")}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
SECONDS=0
$PY setup.py -q build_ext --inplace > /tmp/build.log 2>&1 || { tail -60 /tmp/build.log; return 1 2>/dev/null || exit 1; }
echo "gpu_setup: built replica._C for sm_${TORCH_CUDA_ARCH_LIST} in ${SECONDS} s"
