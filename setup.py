"""Packages for setuptools: xserv_aot, plus the CUDA sources in kernels/ shipped as package data (xserv_aot._kernels),
so a wheel or a non-editable install can compile GPU plans. Everything else is in pyproject.toml."""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["xserv_aot*"]) + ["xserv_aot._kernels", "xserv_aot._kernels.cutlass"],
    package_dir={"xserv_aot._kernels": "kernels"},
    package_data={"xserv_aot._kernels": ["*.cu", "*.cuh"], "xserv_aot._kernels.cutlass": ["*.cu", "*.cuh", "*.h"]},
)
