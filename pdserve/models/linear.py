"""``Linear``: ``nn.Linear`` with CPU routes for half-precision GEMMs.

On a CPU without bf16 GEMM hardware (AVX2 only: no AVX512-BF16, AMX or AVX-NE-CONVERT), torch's
bf16 ``F.linear`` is a generic loop at ~8-10 GFLOP/s of one core's time. ``prepare_small_gemms``
then gives every bf16 ``Linear`` a packed copy of its weight (``kernels.cpu_gemm``: same bytes as
the weight), and while torch runs one intra-op thread every call goes through that kernel:
~60-85 GFLOP/s at 4-512 rows, and at one row it reads the bf16 weight once (docs/benchmarks.md,
"CPU engine on SmolLM2-135M"). With more threads, on CPUs with bf16 hardware and for fp16 the
routes below stay.

On the CPU a bf16 (or fp16) ``F.linear`` goes through oneDNN, whose per-call cost dwarfs the
arithmetic of a small layer: 1 x 128 x 384 takes ~20 us in bf16 and ~7 us in fp32 on the
project's CI host, and inside a decode step (other ops between the GEMMs) ~55 us against ~19.
For weights up to ``SMALL_GEMM_MAX_WEIGHT`` elements, ``prepare_small_gemms`` keeps an fp32
copy (at most 256 KiB each), and calls of up to ``SMALL_GEMM_MAX_ROWS`` rows compute in fp32
from it and round once to the input's dtype. Larger layers, larger calls, fp32 models and every
other device keep the plain path: there the fp32 route is slower (at one row 128 x 384 takes
20 -> 9 us, 1,024 x 3,072 330 -> 407 us: memory-bound; at 64 rows 128 x 384 48 -> 79 us) and
its copy costs memory (docs/benchmarks.md, "The CPU decode step"). A bf16 call of up to
``cpu_native_rowwise.MAX_LINEAR_ROWS`` rows goes one step further: one native call reads the transposed
fp32 copy and rounds once (~4 against ~10 us for 1 x 128 x 384).

Numerics: the products of bf16 values are exact in fp32 and the sum is fp32, as in oneDNN's
bf16 kernel; only the order of the additions differs, so a result can differ from the oneDNN
one by one bf16 rounding step. The CPU bf16 path is not token-identical to ``transformers``'
bf16 path either way (a random tiny model parts from it within 10 tokens; fp32 is the
reference the tests hold to).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu_gemm, cpu_native_rowwise
from pdserve.kernels.backend import HALF_DTYPES, wants_native

SMALL_GEMM_MAX_WEIGHT = 65_536  # elements (fp32 copy <= 256 KiB)
SMALL_GEMM_MAX_ROWS = 16  # past it the fp32 route loses (1 x 128 x 384 at 64 rows: 48 -> 79 us)


class LoRADelta(Protocol):
    """What a layer needs of its served LoRA adapters (``pdserve.lora.apply.LoRASlots``): the
    adapters' contribution added to the base output, row by row."""

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) plus the small-GEMM route once prepared."""

    # The fp32 copy, stored transposed ([in, out] contiguous, what the native kernel reads);
    # weight_fp32 is its [out, in] view, what F.linear takes (MKL reads either layout).
    weight_fp32_t: torch.Tensor | None = None
    weight_fp32: torch.Tensor | None = None
    bias_fp32: torch.Tensor | None = None
    # The packed bf16 copy kernels.cpu_gemm reads (CPUs without bf16 GEMM hardware).
    weight_packed: cpu_gemm.PackedWeight | None = None
    # The slot stacks of served LoRA adapters (pdserve.lora.manager attaches them); each row of
    # a step adds its own adapter's delta.
    lora: LoRADelta | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._forward_base(x)
        return y if self.lora is None else self.lora.add_delta(x, y)

    def _forward_base(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_packed is not None and wants_native(x):  # None when x is not for it
            y = cpu_gemm.linear(x, self.weight_packed, self.bias_fp32)
            if y is not None:
                return y
        w = self.weight_fp32
        if w is not None and x.dim() == 2 and x.shape[0] <= SMALL_GEMM_MAX_ROWS:
            if wants_native(x):  # a few bf16 rows: one native call (kernels.cpu_native_rowwise.linear)
                assert self.weight_fp32_t is not None
                y = cpu_native_rowwise.linear(x, self.weight_fp32_t, self.bias_fp32)
                if y is not None:
                    return y
            return F.linear(x.float(), w, self.bias_fp32).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


def small_gemm_eligible(weight: torch.Tensor) -> bool:
    """Whether a layer with this weight takes the fp32 route for small calls."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in HALF_DTYPES
        and weight.numel() <= SMALL_GEMM_MAX_WEIGHT
    )


def packed_gemm_eligible(weight: torch.Tensor) -> bool:
    """Whether a layer with this weight gets the packed copy of ``kernels.cpu_gemm``: a CPU bf16
    weight on a CPU without bf16 GEMM hardware."""
    return weight.device.type == "cpu" and weight.dtype is torch.bfloat16 and not cpu_gemm.bf16_gemm_native()


def prepare_small_gemms(model: nn.Module) -> int:
    """Give every eligible ``Linear`` of ``model`` its fp32 copy (small layers) and its packed
    bf16 copy (``packed_gemm_eligible``); call once the weights are loaded (a later change to a
    weight is not seen). Returns how many layers got either."""
    n = 0
    for m in model.modules():
        if not isinstance(m, Linear):
            continue
        got = False
        if small_gemm_eligible(m.weight):
            m.weight_fp32_t = m.weight.detach().float().t().contiguous()
            m.weight_fp32 = m.weight_fp32_t.t()
            got = True
        if packed_gemm_eligible(m.weight):
            m.weight_packed = cpu_gemm.pack(m.weight)
            got = got or m.weight_packed is not None
        if got:
            m.bias_fp32 = None if m.bias is None else m.bias.detach().float()
            n += 1
    return n
