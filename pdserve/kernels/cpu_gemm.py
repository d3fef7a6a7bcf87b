"""A bf16-weight GEMM for CPUs without bf16 arithmetic (``cpu_gemm.c``, built into the
``cpu_native`` module): ``F.linear`` of bf16 rows and a bf16 weight, computed in fp32 and rounded
once, from a copy of the weight packed at load time.

Why: on an AVX2 host (no AVX512-BF16, AMX or AVX-NE-CONVERT; ``bf16_gemm_native`` tells) torch's
bf16 GEMM is a generic loop at ~3 GFLOP/s, and oneDNN refuses to pre-pack bf16 weights. This
kernel reaches ~65-75 GFLOP/s on one Zen 3 core at 16-64 rows (FMA on 4 x 16 register blocks),
and at one row reads the bf16 weight once (half the bytes of an fp32 copy).
docs/benchmarks.md ("CPU engine on SmolLM2-135M") has the measurements.

Single-threaded: it is taken only while torch runs one intra-op thread (the engine's CPU default
on a small host, ``EngineConfig.intra_op_threads``); with more, torch's threaded kernels stay.

Numerics: bf16 x bf16 products are exact in fp32; the sum is fp32 (FMA, in order of the input
dimension) and rounded to bf16 once, as the fp32 route of ``models.linear``. The sum order differs
from oneDNN's, so a result can differ from torch's bf16 ``F.linear`` by one bf16 rounding step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels import cpu_native

PANEL = 16  # output columns per packed panel (cpu_gemm.c)


def bf16_gemm_native() -> bool:
    """Whether this CPU has bf16 GEMM hardware that torch uses (oneDNN's bf16 path)."""
    return cpu_native.bf16_gemm_hardware()


@dataclass(frozen=True)
class PackedWeight:
    """A bf16 [out, in] weight in the kernel's layout (``[ceil(out / 16), in, 16]`` bf16)."""

    data: torch.Tensor
    n_out: int
    n_in: int


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """The packed copy of a CPU bf16 ``[out, in]`` weight, or None when the kernel cannot take it
    (no native module, another dtype or device, or a CPU whose bf16 GEMM is native hardware)."""
    lib = cpu_native.library()
    if lib is None or weight.dtype is not torch.bfloat16 or not weight.is_cpu or weight.dim() != 2:
        return None
    if not lib.gemm_simd():  # the portable scalar loop is no faster than torch's
        return None
    w = weight.detach().contiguous()
    n_out, n_in = w.shape
    data = torch.empty(((n_out + PANEL - 1) // PANEL, n_in, PANEL), dtype=torch.bfloat16)
    lib.gemm_pack(w.data_ptr(), n_out, n_in, data.data_ptr())
    return PackedWeight(data, n_out, n_in)


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` for 2-D CPU bf16 ``x`` with unit column stride from the packed
    weight (``bias``: fp32 or None), or None when not for this kernel (then nothing was run)."""
    lib = cpu_native._lib
    if lib is None or x.dtype is not torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1 or x.requires_grad:
        return None
    rows, n_in = x.shape
    if n_in != packed.n_in or torch.get_num_threads() != 1:
        return None
    if bias is not None and (bias.dtype is not torch.float32 or not bias.is_contiguous()):
        return None
    out = torch.empty((rows, packed.n_out), dtype=torch.bfloat16)
    lib.gemm(
        x.data_ptr(), x.stride(0), rows, n_in, packed.data.data_ptr(), packed.n_out,
        None if bias is None else bias.data_ptr(), out.data_ptr(), packed.n_out,
    )  # fmt: skip
    return out
