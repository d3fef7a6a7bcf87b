"""kvtransfer/cuda_runtime.py: the copy methods' names, the descriptor table and the fallback order.

``CudaRuntime.copy`` runs against a stand-in libcudart that records the calls (this module's
unit tests only); the Triton kernel is replaced by a recorder that takes or refuses the copy.
The real calls run in bench/gpu_ipc.py and tests/gpu/test_cuda_ipc_gpu.py on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.errors import ConfigError
from pdserve.kvtransfer.cuda_runtime import BATCHED_COPY_MIN, CudaRuntime, check_copy_method, copy_table


class FakeLib:
    """The libcudart calls ``copy`` makes; ``batch_error``: what cudaMemcpyBatchAsync returns."""

    def __init__(self, batch_error: int = 0) -> None:
        self.calls: list[tuple] = []
        self.batch_error = batch_error

    def cudaSetDevice(self, device):
        return 0

    def cudaStreamCreateWithFlags(self, ptr, flags):
        return 0

    def cudaStreamSynchronize(self, stream):
        self.calls.append(("sync",))
        return 0

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        self.calls.append(("memcpy", src, dst, n))
        return 0

    def cudaMemcpyBatchAsync(self, dsts, srcs, sizes, count, attrs, attr_idx, num_attrs, stream):
        got = [
            np.ctypeslib.as_array((np.ctypeslib.ctypes.c_int64 * count).from_address(p))
            for p in (srcs, dsts, sizes)
        ]
        self.calls.append(("batch", [tuple(map(int, r)) for r in zip(*got, strict=True)]))
        return self.batch_error

    def cudaGetLastError(self):
        return 0

    def cudaGetErrorString(self, code):
        return b"invalid argument"


class Runtime(CudaRuntime):
    """The dispatch of ``CudaRuntime.copy`` with the Triton kernel replaced by a recorder."""

    def __init__(self, method: str, lib: FakeLib, triton_takes: bool = True) -> None:
        super().__init__(method, lib=lib)
        self.lib, self.triton_takes = lib, triton_takes

    def _triton_copy(self, copies, device, variant):
        self.lib.calls.append(("triton", variant, len(copies)))
        return self.triton_takes


COPIES = copy_table([(16 * i, 4096 + 16 * i, 16) for i in range(BATCHED_COPY_MIN)])
MEMCPY_EACH = [("memcpy", s, d, n) for s, d, n in COPIES.tolist()] + [("sync",)]
BATCH = [("batch", [tuple(r) for r in COPIES.tolist()]), ("sync",)]


@pytest.mark.parametrize(
    ("method", "triton_takes", "batch_error", "expect"),
    [
        ("triton", True, 0, [("triton", None, BATCHED_COPY_MIN)]),
        # the kernel refused them (unaligned, or no triton): one memcpy each
        ("triton", False, 0, [("triton", None, BATCHED_COPY_MIN), *MEMCPY_EACH]),
        ("memcpy_batch", True, 0, BATCH),
        # the runtime refused the batch: redone one memcpy each
        ("memcpy_batch", True, 1, [BATCH[0], *MEMCPY_EACH]),
        ("memcpy", True, 0, MEMCPY_EACH),
    ],
)
def test_copy_methods_fall_back_in_order(method, triton_takes, batch_error, expect):
    lib = FakeLib(batch_error)
    rt = Runtime(method, lib, triton_takes)
    rt.copy(COPIES, 0)
    assert lib.calls == expect
    assert ("memcpy_batch" in rt.unavailable) == bool(batch_error)
    if batch_error:  # known now: the next copy skips the batch
        lib.calls.clear()
        rt.copy(COPIES, 0)
        assert lib.calls == MEMCPY_EACH


def test_few_descriptors_go_one_memcpy_each():
    lib = FakeLib()
    Runtime("triton", lib).copy(COPIES[: BATCHED_COPY_MIN - 1], 0)
    assert lib.calls == [*MEMCPY_EACH[: BATCHED_COPY_MIN - 1], ("sync",)]


def test_copy_method_names_are_checked():
    for ok in ("triton", "memcpy_batch", "memcpy"):
        assert check_copy_method(ok) == ok
    for bad in ("cuda", "memcpy:x", "memcpy_batch:chunks-64k"):
        with pytest.raises(ConfigError, match="expected one of"):
            check_copy_method(bad)
    # "triton:<variant>" names are checked in tests/kernels/test_triton_copy.py (triton imported)
    rt = Runtime("memcpy", FakeLib())
    with pytest.raises(ConfigError, match="'fast'"):
        rt.copy_method = "fast"
    assert rt.copy_method == "memcpy"


def test_copy_table_takes_tuples_and_arrays():
    t = copy_table([(16, 32, 48), (64, 80, 96)])
    assert t.dtype == np.int64 and t.tolist() == [[16, 32, 48], [64, 80, 96]]
    assert np.shares_memory(copy_table(t), t)
    assert copy_table([]).shape == (0, 3)
