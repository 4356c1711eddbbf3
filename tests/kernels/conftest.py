"""Fixtures of the kernel tests: the two Kernels implementations.

The CpuKernels tests are skipped when the extension cannot be built on this machine.
"""

from __future__ import annotations

import os
import shutil

import pytest

from laneserve.kernels import CpuKernels, TorchKernels, load_kernels
from laneserve.kernels import build as kbuild


@pytest.fixture(scope="module")
def ck() -> CpuKernels:
    buildable = (
        kbuild.cpu_supported()
        and not kbuild.kernels_disabled()
        and shutil.which(os.environ.get("CXX", "c++")) is not None
    )
    if not buildable:
        pytest.skip("laneserve CPU kernels cannot be built here (CPU, compiler or disabled)")
    lib = load_kernels()
    if lib is None:  # a toolchain is present, so this is a broken source or build setup
        pytest.fail("laneserve CPU kernel extension failed to build (see the WARNING log)")
    return CpuKernels(lib)


@pytest.fixture(scope="module")
def tk() -> TorchKernels:
    return TorchKernels()
