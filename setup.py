"""Builds the torch extension replica._C and lays out the package; its metadata lives in
pyproject.toml."""

import glob
import os
import shutil

import torch
from setuptools import find_packages, setup
from torch.utils import cpp_extension

# No -std flag: torch picks the C++ standard its headers need. -fopenmp: torch
# builds at::parallel_for with OpenMP in our translation units, and without the
# flag its pragma is ignored and every kernel runs on one thread. The loader
# then shares the libgomp that torch itself loaded.
# REPLICA_DEBUG_INFO=0 (`make build`'s default): -g0 after Python's own -g, as debug
# information for torch's headers is most of the compile time.
CXX_FLAGS = [
    "-O3",
    "-fvisibility=hidden",
    "-fopenmp",
    *(["-g0"] if os.environ.get("REPLICA_DEBUG_INFO") == "0" else []),
]
LINK_FLAGS = ["-fopenmp"]

# One import name for users: transport/, roles/ and rayapi/ install inside replica; the examples
# as replica/examples (`replica selftest` runs them). Nothing else ships: not tests/ (nor the
# tests' helpers, tests/support), bench/ or tools/.
PACKAGE_DIR = {
    "replica": "replica",
    "replica.transport": "transport",
    "replica.roles": "roles",
    "replica.ray": "rayapi",
    "replica.examples": "examples",
}
# Each folder's subpackages: the folders below it with an __init__.py (a folder left holding only
# bytecode, __pycache__, is none).
PACKAGES = [
    f"{name}.{sub}" if sub else name for name, folder in PACKAGE_DIR.items() for sub in ["", *find_packages(folder)]
]


def default_cuda_arch_list() -> str | None:
    """The architectures to build for when the user named none and torch cannot ask a GPU.

    With no GPU visible torch's own detection fails (pytorch#137261), and its
    fallback list names architectures that CUDA 13 no longer compiles (sm_50 to
    sm_72). Hopper, and Blackwell with PTX that later GPUs JIT-compile; CUDA
    before 12.8 knows no sm_100.
    """
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.is_available():
        return None
    major, minor = (int(v) for v in torch.version.cuda.split(".")[:2])
    return "9.0;10.0+PTX" if (major, minor) >= (12, 8) else "9.0+PTX"


def extension():
    sources = sorted(glob.glob("csrc/*.cpp"))
    # CUDAExtension refuses a CPU-only torch, so CUDA sources come only when
    # both torch and the machine can build them.
    if torch.version.cuda is not None and shutil.which("nvcc") is not None:
        arch_list = default_cuda_arch_list()
        if arch_list is not None:
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
        return cpp_extension.CUDAExtension(
            "replica._C",
            sources + sorted(glob.glob("csrc/cuda/*.cu")),
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": ["-O3"]},
            extra_link_args=LINK_FLAGS,
        )
    return cpp_extension.CppExtension(
        "replica._C", sources, extra_compile_args={"cxx": CXX_FLAGS}, extra_link_args=LINK_FLAGS
    )


# REPLICA_NO_EXTENSION=1: the package without replica._C, which `make build` then builds in
# place (ninja, incremental); `make` installs the editable package this way so that the
# extension is compiled once, not twice.
setup(
    package_dir=PACKAGE_DIR,
    packages=PACKAGES,
    ext_modules=[] if os.environ.get("REPLICA_NO_EXTENSION") == "1" else [extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
