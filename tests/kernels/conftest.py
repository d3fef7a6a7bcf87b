"""Kernel tests run the Triton kernels under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton decorates any kernel; pdserve imports
``triton_rmsnorm`` lazily, so setting it here (before any test runs) is early enough.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from pdserve import kernels

# scripts/bootstrap.sh installs triton only when asked (PDSERVE_TRITON=1; scripts/test.sh asks):
# without it the tests of the Triton kernels skip, the torch / native ones still run.
TRITON_MISSING = importlib.util.find_spec("triton") is None


@pytest.fixture
def force_triton():
    """Run the test body with the Triton kernels forced (interpreter on CPU, kernels on CUDA)."""
    if TRITON_MISSING:
        pytest.skip(
            "triton is not installed: PDSERVE_TRITON=1 bash scripts/bootstrap.sh (scripts/test.sh does)"
        )
    with kernels.use_backend("triton"):
        yield


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
