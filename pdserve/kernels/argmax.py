"""Row argmax of logits: ``argmax_rows`` dispatch, torch twin and the one capability predicate.

    argmax_rows(x)  ==  x.argmax(dim=-1)        x [rows, vocab] -> int64 [rows], ties -> lowest index

The twin is torch's argmax (the reference, and the path on devices without Triton). On CPU
tensors numpy's argmax runs instead: torch's CPU argmax is not vectorized, ~10x slower in fp32
and ~30x in bf16 (16 x 4,096 logits: 60 / 240 us against 5 / 14 us with the bf16 -> fp32 cast,
which is exact; docs/benchmarks.md, eleventh session). Same answer: the first maximum, the first
NaN in a row holding one. The Triton kernel
(``triton_argmax``) spreads each row over many programs; torch gives a row to one block, about
40 us for a 128k vocabulary on an H200 at batch 1 and 64. Which one runs follows the backend
setting (``pdserve.kernels.backend``) and ``argmax_unsupported_reason``; an unsupported case on
the Triton side raises. NaN rows: torch returns the first NaN; the kernel's choice is
unspecified (greedy decoding of NaN logits has no right answer).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from pdserve.errors import UnsupportedError
from pdserve.kernels.backend import HALF_DTYPES, TRITON_DTYPES, device_unsupported_reason, wants_triton

MAX_COLS = 1 << 30  # chunk indices are int32 in the kernel
_triton_impl: ModuleType | None = None


def argmax_unsupported_reason(x: torch.Tensor) -> str | None:
    """Why the Triton kernel cannot compute this case, or None if it can."""
    reason = device_unsupported_reason(x)
    if reason is not None:
        return reason
    if x.dim() != 2 or not 0 < x.shape[1] <= MAX_COLS:
        return f"x {tuple(x.shape)} must be [rows, n] with 1 <= n <= {MAX_COLS}"
    if x.dtype not in TRITON_DTYPES:
        return f"dtype {x.dtype} is not one of fp16/bf16/fp32"
    return None


def _triton() -> ModuleType:
    global _triton_impl
    if _triton_impl is None:
        from pdserve.kernels import triton_argmax

        _triton_impl = triton_argmax
    return _triton_impl


_NUMPY_DTYPES = (torch.float32, torch.float64)


def argmax_cpu(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a CPU tensor through numpy (same index; see the module docstring)."""
    if x.dim() != 2 or 0 in x.shape or x.dtype not in _NUMPY_DTYPES + HALF_DTYPES:
        return x.argmax(dim=-1)
    a = x.detach()
    if a.dtype in HALF_DTYPES:
        a = a.float()
    return torch.from_numpy(np.argmax(a.numpy(), axis=-1).astype(np.int64, copy=False))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """[rows, n] -> int64 [rows], the index of each row's first maximum; two launches on CUDA."""
    if not wants_triton(x):
        return argmax_cpu(x) if x.device.type == "cpu" else x.argmax(dim=-1)
    reason = argmax_unsupported_reason(x)
    if reason is not None:
        raise UnsupportedError(
            f"no argmax kernel for {tuple(x.shape)} {x.dtype} on {x.device}: {reason}; "
            "use the torch backend (kernels.set_backend('torch')) or a supported case"
        )
    return _triton().argmax_rows_fwd(x if x.stride(-1) == 1 else x.contiguous())
