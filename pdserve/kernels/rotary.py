"""Rotary position embedding (neox style, rotate_half): cos/sin cache, dispatch, torch twin.

The cache holds cos and sin of every position once per model, so a step only gathers rows by
position (no transcendental per step, and a CUDA graph replays a pure gather):

    cos_sin_cache[p] = [ cos(p * inv_freq) | sin(p * inv_freq) ]      # [max_positions, head_dim] fp32
                         0 .. D/2-1          D/2 .. D-1

``inv_freq`` carries the rope type (default, linear, llama3: ``RopeConfig.inv_freq``). Rotating
one head x = [x1 | x2] (halves of D) at position p:

    out = [ x1*cos - x2*sin | x2*cos + x1*sin ]          (== x*cos + rotate_half(x)*sin)

``apply_rotary`` rotates q and k in one call. Which implementation runs follows the backend
setting (``pdserve.kernels.backend``) and the one predicate ``rotary_unsupported_reason``; an
unsupported case on the Triton side raises. Positions are not range-checked on the device (that
would sync and break CUDA graphs): callers keep them below ``cos_sin_cache.shape[0]`` (the engine
caps max_model_len at max_position_embeddings, the cache's length).
"""

from __future__ import annotations

from types import ModuleType

import torch

from pdserve.errors import UnsupportedError
from pdserve.kernels.backend import TRITON_DTYPES, device_unsupported_reason, wants_triton

# One program holds a [heads-block, head_dim/2] tile per half; past this the halves no longer fit
# comfortably in registers (no supported model comes close: 256 is the widest head seen).
MAX_ROTARY_HEAD_DIM = 1024
POSITION_DTYPES = (torch.int32, torch.int64)

_triton_impl: ModuleType | None = None


def rotary_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[max_positions, 2 * len(inv_freq)] fp32 on inv_freq's device: cos | sin per position.

    Same arithmetic as transformers (fp32 position * fp32 inv_freq, then cos/sin), so the values
    equal those it computes per step.
    """
    positions = torch.arange(max_positions, dtype=torch.int64, device=inv_freq.device).float()
    freqs = positions[:, None] * inv_freq.float()[None, :]  # [P, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [P, D]


# ----------------------------------------------------------------------------- capability


def rotary_unsupported_reason(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> str | None:
    """Why the Triton rotary kernel cannot compute this case, or None if it can.

    q: [n, H, D], k: [n, Hkv, D] (any strides), positions: [n] int32/int64, cos_sin_cache:
    [P, D] fp32.
    """
    reason = device_unsupported_reason(q, k, positions, cos_sin_cache)
    if reason is not None:
        return reason
    if q.dim() != 3 or k.dim() != 3:
        return f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [tokens, heads, head_dim]"
    n, _, dim = q.shape
    if k.shape[0] != n or k.shape[2] != dim:
        return f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in tokens and head_dim"
    if q.dtype not in TRITON_DTYPES or k.dtype != q.dtype:
        return f"q/k dtypes {q.dtype}/{k.dtype} must be one of fp16/bf16/fp32, the same for both"
    if dim % 2 or not 0 < dim <= MAX_ROTARY_HEAD_DIM:
        return f"head_dim {dim} must be even and in 2..{MAX_ROTARY_HEAD_DIM}"
    if positions.shape != (n,) or positions.dtype not in POSITION_DTYPES:
        return f"positions {tuple(positions.shape)} {positions.dtype} must be [{n}] int32/int64"
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != dim or cos_sin_cache.dtype != torch.float32:
        return f"cos_sin_cache {tuple(cos_sin_cache.shape)} {cos_sin_cache.dtype} must be [P, {dim}] fp32"
    return None


def rotary_can_run(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> bool:
    """The capability predicate: True iff the Triton rotary kernel can compute this case."""
    return rotary_unsupported_reason(q, k, positions, cos_sin_cache) is None


def _triton() -> ModuleType:
    global _triton_impl
    if _triton_impl is None:
        from pdserve.kernels import triton_rotary

        _triton_impl = triton_rotary
    return _triton_impl


# ----------------------------------------------------------------------------- twin and dispatch


def _rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [n, heads, D]; cos, sin: [n, 1, D/2] fp32 -> rotated, in x.dtype (fp32 inside)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)  # [n, heads, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``[n, H + Hkv, D]``: one view of q and k when k's heads follow q's in memory with the same
    strides (q and k sliced from the fused qkv output), else None."""
    n, h, d = q.shape
    if q.dtype != k.dtype or q.device != k.device or k.shape[0] != n or k.shape[2] != d:
        return None
    if q.stride(-1) != 1 or k.stride(-1) != 1 or q.stride(1) != d or k.stride(1) != d:
        return None
    if n > 1 and q.stride(0) != k.stride(0):  # a dim of size 1 may carry any stride
        return None
    if k.data_ptr() != q.data_ptr() + h * d * q.element_size():
        return None
    if q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr():  # adjacent by chance
        return None
    return q.as_strided((n, h + k.shape[1], d), q.stride())


def apply_rotary_torch(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin: gather cos/sin rows by position, rotate q and k in fp32; new tensors in q.dtype.
    q and k cut from one fused projection are rotated as one tensor (half the small ops that
    bound a CPU decode step; bit-identical: every op is elementwise)."""
    cos, sin = rotary_cos_sin(positions, cos_sin_cache)
    return rotate_qk_torch(q, k, cos, sin)


def rotary_cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin rows of ``positions``, [n, 1, D/2] fp32 each (broadcast over heads): the
    same for every layer of a step, so a caller may compute them once (models/kv_store.py)."""
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [n, D/2] fp32 each
    return cos[:, None], sin[:, None]


def rotate_qk_torch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_torch`` with the positions' cos and sin already gathered (``rotary_cos_sin``)."""
    qk = _adjacent_heads(q, k)
    if qk is None:
        return _rotate_torch(q, cos, sin), _rotate_torch(k, cos, sin)
    out = _rotate_torch(qk, cos, sin)  # [n, H + Hkv, D], new
    h = q.shape[1]
    q_out, k_out = out[:, :h], out[:, h:]
    if q.shape[0] > 1:  # a one-token slice is already contiguous
        q_out, k_out = q_out.contiguous(), k_out.contiguous()
    return q_out, k_out


def apply_rotary(
    q: torch.Tensor,  # [n, H, D], may be a strided view of the fused qkv output
    k: torch.Tensor,  # [n, Hkv, D], likewise
    positions: torch.Tensor,  # [n] int64/int32
    cos_sin_cache: torch.Tensor,  # [P, D] fp32, from rotary_cos_sin_cache
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their tokens' positions; returns new contiguous [n, H, D], [n, Hkv, D].
    Inputs are not written. On CUDA one Triton launch does both (no host sync: graph-safe)."""
    if not wants_triton(q):
        return apply_rotary_torch(q, k, positions, cos_sin_cache)
    reason = rotary_unsupported_reason(q, k, positions, cos_sin_cache)
    if reason is not None:
        raise UnsupportedError(
            f"no rotary kernel for q {tuple(q.shape)} k {tuple(k.shape)} {q.dtype} on {q.device}: "
            f"{reason}; use the torch backend (kernels.set_backend('torch')) or a supported case"
        )
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    return _triton().rotary_fwd(q, k, positions, cos_sin_cache.contiguous())
