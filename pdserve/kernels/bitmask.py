"""Grammar token masks: ``apply_token_bitmask_`` dispatch, torch twin and capability predicate.

    apply_token_bitmask_(logits, bitmask, rows)
        logits  [num_rows, V] fp16 / bf16 / fp32, written in place
        bitmask [k, W] int32: bit j of word w is token 32 * w + j, 1 = allowed; W <= ceil(V / 32):
                tokens past 32 * W are banned (a grammar over a tokenizer smaller than the model's
                padded vocabulary)
        rows    [k] int64 on the logits' device: the logits row of each bitmask row; None = 0..k-1

A token whose bit is 0 becomes -inf in its row; rows not named keep their logits untouched, so a
mixed batch pays only for its constrained rows. The bitmask is compact (one row per constrained
request, xgrammar's layout), not one row per batch row. The Triton kernel is one launch over
(k, vocabulary chunks); the torch twin unpacks the bits into a [k, V] mask.
"""

from __future__ import annotations

import sys
from types import ModuleType

import numpy as np
import torch

from pdserve.errors import UnsupportedError
from pdserve.kernels import cpu_native_rowwise
from pdserve.kernels.backend import (
    NEG_INF_BITS,
    TRITON_DTYPES,
    device_unsupported_reason,
    get_backend,
    wants_triton,
)

_triton_impl: ModuleType | None = None


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    assert logits.dim() == 2 and bitmask.dim() == 2, (tuple(logits.shape), tuple(bitmask.shape))
    assert bitmask.dtype == torch.int32 and (bitmask.shape[1] - 1) * 32 < logits.shape[1], (
        bitmask.dtype,
        tuple(bitmask.shape),
        tuple(logits.shape),
    )
    k = bitmask.shape[0]
    assert (rows is None and k <= logits.shape[0]) or (rows is not None and rows.shape == (k,)), k


def bitmask_unsupported_reason(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None
) -> str | None:
    """Why the Triton kernel cannot run this case, or None if it can."""
    reason = device_unsupported_reason(logits, bitmask, *(() if rows is None else (rows,)))
    if reason is not None:
        return reason
    if logits.dtype not in TRITON_DTYPES:
        return f"dtype {logits.dtype} is not one of fp16/bf16/fp32"
    if logits.stride(1) != 1 or not bitmask.is_contiguous():
        return "logits rows and the bitmask must be contiguous"
    return None


_BANNED_BITS: dict[torch.device, torch.Tensor] = {}


def _banned_bits(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: bit j of byte value b is 0 (token banned). One table per device."""
    t = _BANNED_BITS.get(device)
    if t is None:
        t = ((torch.arange(256, device=device).unsqueeze(-1) >> torch.arange(8, device=device)) & 1) == 0
        _BANNED_BITS[device] = t
    return t


# dtype -> bit patterns of (-inf, +inf) in a numpy integer type of the dtype's width
_INF_BITS: dict[torch.dtype, tuple[type, int, int]] = {
    torch.float32: (np.int32, NEG_INF_BITS[torch.float32], 0x7F800000),
    torch.bfloat16: (np.int16, NEG_INF_BITS[torch.bfloat16], 0x7F80),
    torch.float16: (np.int16, NEG_INF_BITS[torch.float16], 0x7C00),
}
_PENALTY: dict[torch.dtype, np.ndarray] = {}


def _penalty_table(dtype: torch.dtype) -> np.ndarray | None:
    """[256, 8] bit patterns: entry [b, j] is +inf if bit j of byte value b is 1 (allowed), else -inf."""
    table = _PENALTY.get(dtype)
    if table is None and dtype in _INF_BITS:
        itype, neg, pos = _INF_BITS[dtype]
        bits = (np.arange(256)[:, None] >> np.arange(8)) & 1
        table = _PENALTY[dtype] = np.where(bits == 1, pos, neg).astype(itype)
    return table


def _banned_np(bitmask: torch.Tensor) -> np.ndarray:
    """[k, W] int32 CPU bitmask -> [k, 32 W] uint8, 1 = banned (bit j of byte b is token 8 b + j,
    little-endian): numpy unpacks the bits in one call (~6 us for 16 x 4,096 tokens, where a
    torch gather of a byte -> bits table takes ~100)."""
    return np.unpackbits(np.invert(bitmask.numpy().view(np.uint8)), axis=-1, bitorder="little")


def _mask_cpu_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> bool:
    """The CPU path of ``apply_token_bitmask_``: one vectorised ``torch.minimum`` of the logits
    with a penalty of +inf (allowed) / -inf (banned) in the logits' dtype, built with one
    ``np.take`` of a byte -> 8 penalties table (bit j of byte b is token 8 b + j on a
    little-endian host). The penalty covers the columns past the bitmask (-inf) and, when
    ``rows`` names the constrained rows, every row (+inf in the others), so there is no gather
    or scatter of logits rows. 16 x 4,096 logits in ~25-35 us, where unpacking the bits and a
    boolean ``where`` took ~80-250, and the gather / tail fill / scatter around it as much again
    (docs/benchmarks.md, "The CPU decode step"). False when this case is not one it takes.

    A NaN logit of a banned token stays NaN here (minimum propagates NaN; ``masked_fill_``
    makes it -inf). NaN logits are a broken model either way."""
    table = _penalty_table(logits.dtype)
    if table is None or sys.byteorder != "little" or logits.stride(1) != 1:
        return False
    itype, neg, pos = _INF_BITS[logits.dtype]
    k, vocab = bitmask.shape[0], logits.shape[1]
    n = min(vocab, 32 * bitmask.shape[1])
    allowed = np.take(table, bitmask.numpy().view(np.uint8), axis=0).reshape(k, -1)  # [k, 32 W]
    if rows is None:
        target = logits[:k]
        if n == vocab:
            pen = allowed[:, :n]
        else:
            pen = np.empty((k, vocab), itype)
            pen[:, :n] = allowed[:, :n]
            pen[:, n:] = neg
    else:
        target = logits
        pen = np.full(tuple(logits.shape), pos, itype)
        at = rows.numpy()
        pen[at, :n] = allowed[:, :n]
        pen[at, n:] = neg
    torch.minimum(target, torch.from_numpy(pen).view(logits.dtype), out=target)
    return True


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    k, vocab = bitmask.shape[0], logits.shape[1]
    if k == 0:
        return
    bitmask = bitmask.contiguous()  # the byte views below need it (a no-op for xgrammar's rows)
    if logits.device.type == "cpu" and bitmask.device.type == "cpu" and _mask_cpu_(logits, bitmask, rows):
        return
    n = min(vocab, 32 * bitmask.shape[1])
    target = logits[:k] if rows is None else logits.index_select(0, rows)  # [k, V]
    head = target[:, :n]
    if sys.byteorder == "little" and bitmask.device.type == "cpu":
        banned = torch.from_numpy(_banned_np(bitmask).view(np.bool_))  # [k, 32 W], True = banned
    elif sys.byteorder == "little":
        # One gather of a byte -> 8 bits table: about half the time of shifting every word by
        # 0..31 and comparing. Byte b of word w holds tokens 32 w + 8 b .. + 7 on a little-endian
        # host.
        banned = _banned_bits(bitmask.device)[bitmask.view(torch.uint8).long()].view(k, -1)
    else:
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        banned = (((bitmask.unsqueeze(-1) >> shifts) & 1) == 0).view(k, -1)  # [k, 32 W]
    head.masked_fill_(banned[:, :n].to(head.device), float("-inf"))
    if n < vocab:  # past the bitmask: banned
        target[:, n:] = float("-inf")
    if rows is not None:
        logits.index_copy_(0, rows, target)


def _triton() -> ModuleType:
    global _triton_impl
    if _triton_impl is None:
        from pdserve.kernels import triton_bitmask

        _triton_impl = triton_bitmask
    return _triton_impl


def apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """Set the disallowed tokens of ``logits[rows]`` to -inf, in place (no host sync)."""
    _check(logits, bitmask, rows)
    if not wants_triton(logits):
        # CPU, backend auto: the native kernel (~10 us for 16 x 4,096) where it takes the case
        if (
            get_backend() == "auto"
            and logits.is_cpu
            and cpu_native_rowwise.apply_bitmask_(logits, bitmask, rows)
        ):
            return
        apply_token_bitmask_torch(logits, bitmask, rows)
        return
    reason = bitmask_unsupported_reason(logits, bitmask, rows)
    if reason is not None:
        raise UnsupportedError(
            f"no bitmask kernel for {tuple(logits.shape)} {logits.dtype} on {logits.device}: {reason}; "
            "use the torch backend (kernels.set_backend('torch')) or a supported case"
        )
    if bitmask.shape[0]:
        _triton().apply_token_bitmask_fwd(logits, bitmask, rows)
