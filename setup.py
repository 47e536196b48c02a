"""Builds the compiled parts (C++17, pybind11): the drafter core and the verifier's CPU kernels; the rest of the
metadata is in pyproject.toml."""

from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "drafter_service._core",
            sorted(glob("drafter_service/csrc/*.cc")),
            depends=sorted(glob("drafter_service/csrc/*.h")),
            cxx_std=17,
            extra_compile_args=["-O2"],
        ),
        # No torch headers: they take raw pointers (the verifier checks the tensors), so they build in seconds
        # without torch installed. OpenMP: their threads are torch's (libgomp.so.1, see csrc/kernels.h).
        Pybind11Extension(
            "verifier_service._cpu_kernels",
            sorted(glob("verifier_service/csrc/*.cc")),
            depends=sorted(glob("verifier_service/csrc/*.h")),
            cxx_std=17,
            extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno"],
            extra_link_args=["-fopenmp"],
        ),
    ],
    cmdclass={"build_ext": build_ext},
)
