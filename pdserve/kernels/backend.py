"""The process-wide kernel backend setting shared by every kernel family in ``pdserve.kernels``.

    backend   tensor on    -> runs
    -------   ---------    ----------------------------------------------------------------
    auto      CPU, bf16    native C kernel where one fits (cpu_native: norms, silu * up, rotary +
                           KV store, attention, small GEMMs; the grammar mask for any CPU
                           logits dtype), else the torch twin
    auto      CPU / other  torch twin (no triton import, one compare of overhead)
    auto      CUDA         Triton kernel; an unsupported case raises UnsupportedError
    triton    any          Triton kernel (CPU needs TRITON_INTERPRET=1); else UnsupportedError
    torch     any          torch twin

Each family (rmsnorm, rotary, activation) has its own capability predicate; this module holds
only the setting, the device half of those predicates and the decision that combines them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, get_args

import torch

from pdserve.errors import ConfigError

Backend = Literal["auto", "torch", "triton"]
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HALF_DTYPES = (torch.bfloat16, torch.float16)  # exactly representable in fp32
# dtype -> the bit pattern of -inf as a signed integer of the dtype's width (the grammar masks
# write it: bitmask.py's penalty table, cpu_native's C pass)
NEG_INF_BITS: dict[torch.dtype, int] = {
    torch.float32: -0x00800000,  # 0xFF800000 as int32
    torch.bfloat16: -0x0080,  # 0xFF80 as int16
    torch.float16: -0x0400,  # 0xFC00 as int16
}

_backend: Backend = "auto"


def get_backend() -> Backend:
    return _backend


def set_backend(backend: Backend) -> Backend:
    """Set the process-wide kernel backend; returns the previous one (tests, benchmarks)."""
    global _backend
    if backend not in get_args(Backend):
        raise ConfigError(f"kernel backend {backend!r} is not one of {get_args(Backend)}")
    previous, _backend = _backend, backend
    return previous


@contextmanager
def use_backend(backend: Backend) -> Iterator[None]:
    """Run a block with ``backend`` forced, restoring the previous setting afterwards."""
    previous = set_backend(backend)
    try:
        yield
    finally:
        set_backend(previous)


def device_unsupported_reason(x: torch.Tensor, *operands: torch.Tensor) -> str | None:
    """Why no Triton kernel can run on these tensors' device, or None: CUDA (or the interpreter),
    one device for all (or pinned host memory beside a CUDA ``x``)."""
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"tensor on {x.device} needs CUDA, or TRITON_INTERPRET=1 set before importing triton"
    for t in operands:
        # A pinned host operand of a CUDA kernel is read in place (unified addressing);
        # kernels.argmax.host_operands_readable tells whether this device can.
        if t.device != x.device and not (
            x.device.type == "cuda" and t.device.type == "cpu" and t.is_pinned()
        ):
            return f"operands on {t.device} and {x.device}; they must share one device"
    return None


def wants_triton(x: torch.Tensor) -> bool:
    """Whether this call should take a Triton kernel (the caller then checks its predicate and
    raises if it cannot run). The CPU hot path costs two compares and no triton import."""
    return not (_backend == "torch" or (_backend == "auto" and x.device.type != "cuda"))


def wants_native(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` may take a native CPU kernel (``kernels.cpu_native_rowwise`` or
    ``kernels.cpu_native_attention``, which then checks the rest and answers None when the case is
    not for it): backend auto, a CPU bf16 tensor."""
    return _backend == "auto" and x.dtype is torch.bfloat16 and x.device.type == "cpu"


def small_to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small tensor of Python numbers on ``device``, queued without waiting for the device
    (``host_to_device`` of ``torch.tensor(data, dtype=dtype)``)."""
    return host_to_device(torch.tensor(data, dtype=dtype), device)


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``, queued without waiting for the device.

    ``t.to("cuda")`` from pageable memory (and ``torch.tensor(data, device="cuda")``) waits for the
    stream, i.e. for every kernel queued before it: called while a step is being launched it stalls
    the host until the previous step finished, which undoes asynchronous scheduling. Through a
    pinned buffer (torch's caching host allocator keeps it until the copy ran) the copy is only
    queued. The engine's own per-step copies use its pinned staging slots
    (``engine.host_batch.PinnedStaging``); this serves code without one (models, LoRA tables).
    """
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
