"""Builds the torch extension replica._C; package metadata lives in pyproject.toml."""

import glob
import shutil

import torch
from setuptools import setup
from torch.utils import cpp_extension

# No -std flag: torch picks the C++ standard its headers need. -fopenmp: torch
# builds at::parallel_for with OpenMP in our translation units, and without the
# flag its pragma is ignored and every kernel runs on one thread. The loader
# then shares the libgomp that torch itself loaded.
CXX_FLAGS = ["-O3", "-fvisibility=hidden", "-fopenmp"]
LINK_FLAGS = ["-fopenmp"]


def extension():
    sources = sorted(glob.glob("csrc/*.cpp"))
    # CUDAExtension refuses a CPU-only torch, so CUDA sources come only when
    # both torch and the machine can build them.
    if torch.version.cuda is not None and shutil.which("nvcc") is not None:
        return cpp_extension.CUDAExtension(
            "replica._C",
            sources + sorted(glob.glob("csrc/cuda/*.cu")),
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": ["-O3"]},
            extra_link_args=LINK_FLAGS,
        )
    return cpp_extension.CppExtension(
        "replica._C", sources, extra_compile_args={"cxx": CXX_FLAGS}, extra_link_args=LINK_FLAGS
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
