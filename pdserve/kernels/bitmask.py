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
from pdserve.kernels.backend import TRITON_DTYPES, device_unsupported_reason, wants_triton

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
_NEG_INF = torch.tensor(float("-inf"))  # 0-dim: where() takes it as a scalar of the logits' dtype


def _banned_bits(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: bit j of byte value b is 0 (token banned). One table per device."""
    t = _BANNED_BITS.get(device)
    if t is None:
        t = ((torch.arange(256, device=device).unsqueeze(-1) >> torch.arange(8, device=device)) & 1) == 0
        _BANNED_BITS[device] = t
    return t


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    k, vocab = bitmask.shape[0], logits.shape[1]
    if k == 0:
        return
    if sys.byteorder == "little" and bitmask.device.type == "cpu" and bitmask.is_contiguous():
        # numpy unpacks the bits in one call (~6 us for 16 x 4,096 tokens, where the gather below
        # takes ~100: docs/benchmarks.md); bit j of byte b is token 8 b + j, little-endian.
        bits = np.unpackbits(np.invert(bitmask.numpy().view(np.uint8)), axis=-1, bitorder="little")
        banned = torch.from_numpy(bits.view(np.bool_))  # [k, 32 W], True = banned
    elif sys.byteorder == "little":
        # One gather of a byte -> 8 bits table: about half the time of shifting every word by
        # 0..31 and comparing on the CPU (16 x 4,096 logits: ~50 against ~110 us). Byte b of word
        # w holds tokens 32 w + 8 b .. + 7 on a little-endian host.
        banned = _banned_bits(bitmask.device)[bitmask.view(torch.uint8).long()].view(k, -1)
    else:
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        banned = (((bitmask.unsqueeze(-1) >> shifts) & 1) == 0).view(k, -1)  # [k, 32 W]
    n = min(vocab, banned.shape[1])
    target = logits[:k] if rows is None else logits.index_select(0, rows)  # [k, V]
    head = target[:, :n]
    if head.device.type == "cpu":
        # where() written into the logits: half of masked_fill_'s time on the CPU (16 x 4,096
        # fp32: 69 against 144 us; docs/benchmarks.md, tenth session)
        torch.where(banned[:, :n], _NEG_INF, head, out=head)
    else:
        head.masked_fill_(banned[:, :n], float("-inf"))
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
