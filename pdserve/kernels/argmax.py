"""Row argmax of logits: ``argmax_rows`` dispatch, torch twin and the one capability predicate.

    argmax_rows(x)  ==  x.argmax(dim=-1)        x [rows, vocab] -> int64 [rows], ties -> lowest index

The twin is torch's argmax (the reference, and the path on devices without Triton). On CPU
tensors numpy's argmax runs instead: torch's CPU argmax is not vectorized, ~10x slower in fp32
and ~30x in bf16 (16 x 4,096 logits: 60 / 240 us against 5 / 14 us with the bf16 -> fp32 cast,
which is exact; docs/benchmarks.md, "The CPU decode step"). Same answer: the first maximum, the first
NaN in a row holding one. The Triton kernel
(``triton_argmax``) spreads each row over many programs; torch gives a row to one block, about
40 us for a 128k vocabulary on an H200 at batch 1 and 64. Which one runs follows the backend
setting (``pdserve.kernels.backend``) and ``argmax_unsupported_reason``; an unsupported case on
the Triton side raises. NaN rows: torch returns the first NaN; the kernel's choice is
unspecified (greedy decoding of NaN logits has no right answer).
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import numpy as np
import torch

from pdserve.errors import UnsupportedError
from pdserve.kernels.backend import HALF_DTYPES, TRITON_DTYPES, device_unsupported_reason, wants_triton

logger = logging.getLogger(__name__)
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


def masked_argmax_rows(
    x: torch.Tensor, bitmask: torch.Tensor, row_map: torch.Tensor | None = None
) -> torch.Tensor:
    """``argmax_rows`` of ``x`` after ``apply_token_bitmask_``'s grammar mask, without writing
    ``x``: row i is masked by bitmask row ``row_map[i]`` (int32; -1: the row is not constrained;
    None: bitmask row i, which needs as many bitmask rows as ``x`` has). On CUDA one launch does
    the mask and the chunk maxima; the bitmask and the row map may be pinned host tensors there
    where ``host_operands_readable`` says so (read in place, nothing copied)."""
    assert bitmask.dim() == 2 and bitmask.dtype == torch.int32, (bitmask.dtype, tuple(bitmask.shape))
    assert (row_map is None and bitmask.shape[0] == x.shape[0]) or (
        row_map is not None and row_map.shape == (x.shape[0],)
    ), (tuple(x.shape), tuple(bitmask.shape))
    if not wants_triton(x):
        return masked_argmax_torch(x, bitmask, row_map)
    reason = argmax_unsupported_reason(x)
    if reason is not None:
        raise UnsupportedError(
            f"no masked argmax kernel for {tuple(x.shape)} {x.dtype} on {x.device}: {reason}; "
            "use the torch backend (kernels.set_backend('torch')) or a supported case"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _triton().masked_argmax_rows_fwd(x, bitmask.contiguous(), row_map)


def masked_argmax_torch(x: torch.Tensor, bitmask: torch.Tensor, row_map: torch.Tensor | None) -> torch.Tensor:
    """The twin of ``masked_argmax_rows``: the mask on a copy of ``x``, then ``argmax_rows``."""
    from pdserve.kernels.bitmask import apply_token_bitmask_

    y = x.clone()
    bitmask = bitmask.to(x.device)
    if row_map is None:
        apply_token_bitmask_(y, bitmask, None)
    else:
        m = row_map.to(x.device, torch.int64)
        rows = (m >= 0).nonzero().squeeze(1)
        apply_token_bitmask_(y, bitmask.index_select(0, m.index_select(0, rows)), rows)
    return argmax_rows(y)


@functools.cache
def host_operands_readable(device: torch.device) -> bool:
    """Whether a Triton kernel on this CUDA device reads pinned host tensors in place (their
    pages mapped into the device's address space: CUDA's unified addressing). Asked once per
    device, by running the masked argmax on a one-row pinned bitmask that bans the row's
    maximum; False on any error or a wrong answer (callers then copy the bitmask over)."""
    try:
        x = torch.zeros(1, 64, device=device)
        x[0, 5], x[0, 7] = 1.0, 2.0
        bitmask = torch.full((1, 2), -1, dtype=torch.int32).pin_memory()
        bitmask[0, 0] = ~(1 << 7)  # token 7 banned: the answer is 5
        ok = int(_triton().masked_argmax_rows_fwd(x, bitmask, None).item()) == 5
    except Exception as e:  # a launcher that refuses host pointers, a driver without UVA
        logger.info("pinned host tensors are not readable by kernels on %s (%s): copying them", device, e)
        return False
    if not ok:
        logger.warning("a kernel read a pinned host bitmask wrongly on %s: copying bitmasks", device)
    return ok
