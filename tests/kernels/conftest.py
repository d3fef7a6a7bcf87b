"""Kernel tests run the Triton kernels under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton decorates any kernel; pdserve imports
``triton_rmsnorm`` lazily, so setting it here (before any test runs) is early enough.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from pdserve import kernels


@pytest.fixture
def force_triton():
    """Run the test body with the Triton kernels forced (interpreter on CPU, kernels on CUDA)."""
    with kernels.use_backend("triton"):
        yield


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
