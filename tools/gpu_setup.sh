#!/usr/bin/env bash
# Sets up a bare GPU machine (CUDA 13, its own torch, no registry) for replica's GPU checks:
# installs the wheels carried in .whl (ucxx-cu13 and what it needs; see docs/operations.md "On a GPU"),
# then builds replica._C in place for the local GPU. Source it: it exports PYTHONPATH.
set -u
PY=${PY:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1 2>/dev/null || exit 1
fi
# The repository itself (no `pip install -e .` there: no build backend), its package-dir
# mapping as links, and the tests' helpers; role processes that `replica launch` starts
# inherit it.
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests:$PWD/examples${PYTHONPATH:+:$PYTHONPATH}
ln -sfn ../transport replica/transport; ln -sfn ../roles replica/roles
# The GPU image's CXX, /opt/gcc/bin/g++, links libstdc++ statically into _C: a second copy of
# its locale machinery, and _C's own error messages segfaulted when they formatted a number
# (seen on an H100 in cuda-gdb; tests/test_package.py now refuses such a build). The system
# compiler links the libstdc++ the process loads. REPLICA_KEEP_CXX=1 keeps the caller's CXX.
if [[ -z ${REPLICA_KEEP_CXX:-} && -x /usr/bin/g++ ]]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
echo "gpu_setup: compiler ${CXX:-default}: $(${CXX:-c++} --version | head -1)"
# UCX from the wheel, not a system one; cuda_copy/cuda_ipc need the wheel's plugins.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$($PY -c "import torch; c=torch.cuda.get_device_capability(); print(f'{c[0]}.{c[1]}')")}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
SECONDS=0
build() { $PY setup.py -q build_ext --inplace > /tmp/build.log 2>&1; }
if ! build; then
  if [[ ${CXX:-} == /usr/bin/g++ ]]; then
    echo "gpu_setup: the build with /usr/bin/g++ failed; again with the default compiler"; tail -5 /tmp/build.log
    unset CXX CC; rm -rf build
  fi
  build || { tail -60 /tmp/build.log; return 1 2>/dev/null || exit 1; }
fi
echo "gpu_setup: built replica._C for sm_${TORCH_CUDA_ARCH_LIST} in ${SECONDS} s"
