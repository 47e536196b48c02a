"""Builds the compiled drafter core (C++17, pybind11); the rest of the metadata is in pyproject.toml."""

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
        )
    ],
    cmdclass={"build_ext": build_ext},
)
