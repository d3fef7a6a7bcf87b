"""Native CPU kernels for small bf16 steps: ``cpu_native.c``, a CPython extension module built on
first use with the host's C compiler (and Python's headers) and imported from a cache.

Why: a CPU decode step of a small model is bound by the count of torch ops, each ~1-2 us of
dispatch, not by arithmetic. On the tiny bench Llama (hidden 128, 4 layers) at one request a
step spent ~31 us per fused add + RMS norm, ~60 us per layer on rotary + KV store and ~75 us per
layer on attention (docs/benchmarks.md, "The CPU decode step"). Each function here is one call for one
of those: ~3-5 us with the Python around it (an output tensor's allocation is ~1 us of that; a
call through ctypes was ~2 us on its own, so the functions take addresses as Python ints through
CPython's fast-call protocol instead).

When: ``backend`` "auto" (the default), a CPU bf16 tensor, and the work under each function's
cap (past it torch's vectorised, multi-threaded kernels win); the callers in ``rmsnorm``,
``activation``, ``models.kv_store`` and ``models.attention_torch`` fall back to their torch twins
when a function here returns None. Backend "torch" never comes here.

``PDSERVE_CPU_KERNELS`` (read once, at first use):
  auto    (default) native when the module builds (a C compiler and Python.h); otherwise the
          torch twins, one warning
  torch   never native
  native  native required: a failed build raises (tests and benchmarks that must measure it)

Building, caching and loading the module: ``cpu_native_build``.

Numerics (bf16 only; fp16 and fp32 keep the torch twins): elementwise results (rotary, the KV
store, the residual add) are the twins' bits; the norm's mean of squares and attention's sums
are added in another order, and silu and attention use a polynomial exp (their AVX2 + FMA loops,
``cpu_activation.c`` and ``cpu_attention.c``, where the CPU has both) or the C library's expf (the
scalar loops), so those can differ from the twin by one bf16 rounding step. The CPU bf16 path was not token-identical to ``transformers`` before
either (models/linear.py); fp32, the path the token-identity tests hold, does not come here.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from types import ModuleType

import torch

from pdserve.errors import ConfigError
from pdserve.kernels.backend import NEG_INF_BITS
from pdserve.kernels.cpu_native_build import load

logger = logging.getLogger(__name__)

ENV = "PDSERVE_CPU_KERNELS"
MODES = ("auto", "torch", "native")

# Caps on one call's work: past them torch's kernels (vectorised, threaded) are as fast or faster.
MAX_ROW_ELEMENTS = 1 << 16  # norms: rows x width
# silu * up: the portable C loop calls the C library's scalar expf, torch's kernel is vectorised:
# the native call wins only at one small row (1 x 512: 4.7 against 5.1 us; 16 x 512: 25.4 against 8.2)
MAX_SILU_ELEMENTS = 512
# ... and the AVX2 loop (cpu_activation.c, on a CPU with AVX2 + FMA: the module's SILU_SIMD)
MAX_SILU_ELEMENTS_SIMD = 1 << 20
MAX_HEAD_DIM = 512  # the C side's stack buffers
MAX_HEADS_PER_KV = 64  # attention: query heads sharing one KV head (likewise)
MAX_ATTENTION_SCORES = 1 << 15  # attention: (query, key) pairs x heads of one call
# ... of a pure decode call on a CPU without bf16 GEMM hardware, where the torch twin's bf16 bmm is
# a generic loop: at 64 requests x 9 heads x ~150 keys its bmm took ~11 ms a call (SmolLM2-135M,
# docs/benchmarks.md, "CPU engine on SmolLM2-135M"). Prefill chunks keep the cap above (the
# twin's flash attention beats this kernel there).
MAX_DECODE_SCORES_NO_BF16_HW = 1 << 22
MAX_LINEAR_ROWS = 4  # the small-layer GEMM (models/linear.py's fp32 route): rows of one call

_lock = threading.Lock()
_lib: ModuleType | None = None
_loaded = False  # the one attempt was made (its result is _lib)
_load_error: str | None = None


def mode() -> str:
    """``PDSERVE_CPU_KERNELS``, checked."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ConfigError(f"{ENV}={value!r} is not one of {', '.join(MODES)}")
    return value


def library() -> ModuleType | None:
    """The loaded library, or None (mode "torch", or the build failed in mode "auto")."""
    global _lib, _loaded, _load_error
    if _loaded:
        return _lib
    with _lock:
        if _loaded:
            return _lib
        m = mode()
        if m == "torch":
            _load_error = f"{ENV}=torch"
        else:
            try:
                _lib = load()
            except (RuntimeError, OSError, ImportError) as e:
                _load_error = str(e)
                if m == "native":
                    raise RuntimeError(f"{ENV}=native but the native CPU kernels are unavailable: {e}") from e
                logger.warning("native CPU kernels unavailable, using the torch twins: %s", e)
        _loaded = True
        return _lib


def available() -> bool:
    return library() is not None


def unavailable_reason() -> str | None:
    library()
    return _load_error if _lib is None else None


@functools.cache
def bf16_gemm_hardware() -> bool:
    """Whether torch runs bf16 GEMMs on hardware support here (oneDNN: AVX512-BF16, AMX or
    AVX-NE-CONVERT); without it torch's bf16 mm / bmm are generic loops."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def score_cap(decode: bool) -> int:
    """The most (query, key) pairs x heads one ``attention`` call takes."""
    return MAX_DECODE_SCORES_NO_BF16_HW if decode and not bf16_gemm_hardware() else MAX_ATTENTION_SCORES


def _reset_for_tests() -> None:
    global _lib, _loaded, _load_error
    with _lock:
        _lib, _loaded, _load_error = None, False, None


_BF16 = torch.bfloat16


def _as_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, width] with unit column stride (a 2-D view as it is, or a contiguous tensor
    flattened), or None. The callers' hot case is 2-D."""
    if x.dim() == 2:
        return x if x.stride(1) == 1 else None
    if x.dim() > 2 and x.is_contiguous():
        return x.view(-1, x.shape[-1])
    return None


def _row_stride(x: torch.Tensor) -> int:
    return x.stride(0) if x.shape[0] > 1 else x.shape[1]


def _weight_ok(weight: torch.Tensor, h: int) -> bool:
    return (
        weight.dtype is _BF16
        and weight.is_cpu
        and weight.dim() == 1
        and weight.shape[0] == h
        and weight.stride(0) == 1
    )


# The hot wrappers below are written for their cost: every attribute read of a tensor is
# ~0.1-0.3 us, and they run ~10 times a layer. Their callers have checked ``wants_native(x)``:
# backend auto, x a CPU bf16 tensor.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``rms_norm_torch`` in one call, or None when this case is not for the native kernel."""
    lib = _lib if _loaded else library()
    if lib is None or x.dtype is not _BF16 or x.requires_grad or not x.is_cpu:
        return None
    rows = _as_rows(x)
    if rows is None:
        return None
    n, h = rows.shape
    if h == 0 or n * h > MAX_ROW_ELEMENTS or not _weight_ok(weight, h):
        return None
    out = torch.empty(x.shape, dtype=_BF16)
    lib.rms_norm(rows.data_ptr(), _row_stride(rows), weight.data_ptr(), eps, out.data_ptr(), n, h)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``fused_add_rms_norm_torch`` in one call, or None when not for the native kernel."""
    lib = _lib if _loaded else library()
    if lib is None or x.dtype is not _BF16 or residual.dtype is not _BF16 or not x.is_cpu:
        return None
    if x.requires_grad or residual.requires_grad:
        return None
    rx, rr = _as_rows(x), _as_rows(residual)
    if rx is None or rr is None or not residual.is_cpu or rx.shape != rr.shape:
        return None
    n, h = rx.shape
    if h == 0 or n * h > MAX_ROW_ELEMENTS or not _weight_ok(weight, h):
        return None
    out = torch.empty(x.shape, dtype=_BF16)
    new_residual = torch.empty(x.shape, dtype=_BF16)
    lib.add_rms_norm(
        rx.data_ptr(), _row_stride(rx), rr.data_ptr(), _row_stride(rr), weight.data_ptr(), eps,
        out.data_ptr(), new_residual.data_ptr(), n, h,
    )  # fmt: skip
    return out, new_residual


def silu_cap(lib: ModuleType) -> int:
    """The most gate + up elements one ``silu_mul`` call takes (the AVX2 loop's cap or the scalar one's)."""
    return MAX_SILU_ELEMENTS_SIMD if lib.SILU_SIMD else MAX_SILU_ELEMENTS


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu_and_mul_torch`` in one call ([..., 2 I] -> [..., I]), or None."""
    lib = _lib if _loaded else library()
    if lib is None or gate_up.dtype is not _BF16 or gate_up.requires_grad or not gate_up.is_cpu:
        return None
    rows = _as_rows(gate_up)
    if rows is None:
        return None
    n, width = rows.shape
    if width == 0 or width % 2 or n * width > silu_cap(lib):
        return None
    inter = width // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=_BF16)
    lib.silu_mul(rows.data_ptr(), _row_stride(rows), out.data_ptr(), n, inter)
    return out


def linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``F.linear(x.float(), weight_t.t(), bias).to(bf16)`` in one call for a few bf16 rows
    (``MAX_LINEAR_ROWS``), or None. ``weight_t``: the fp32 copy ``models.linear`` keeps of a small
    layer, transposed ([in, out] contiguous: the kernel accumulates whole output rows)."""
    lib = _lib if _loaded else library()
    if lib is None or x.dtype is not _BF16 or x.requires_grad or not x.is_cpu or x.dim() != 2:
        return None
    rows, n_in = x.shape
    if rows > MAX_LINEAR_ROWS or x.stride(1) != 1 or weight_t.dtype is not torch.float32:
        return None
    if weight_t.dim() != 2 or weight_t.shape[0] != n_in or not weight_t.is_contiguous():
        return None
    n_out = weight_t.shape[1]
    if bias is not None and (
        bias.dtype is not torch.float32 or bias.shape != (n_out,) or bias.stride(0) != 1
    ):
        return None
    out = torch.empty((rows, n_out), dtype=_BF16)
    lib.linear(
        x.data_ptr(), _row_stride(x), weight_t.data_ptr(), None if bias is None else bias.data_ptr(),
        out.data_ptr(), rows, n_in, n_out,
    )  # fmt: skip
    return out


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> bool:
    """``kernels.apply_token_bitmask_`` on CPU logits (fp32, bf16 or fp16) in one call: the
    tokens row i of ``bitmask`` bans in ``logits[rows[i]]`` (row i when ``rows`` is None), and
    every column past the bitmask, := -inf, in place. False when not for the native kernel (then
    nothing was written). Any dtype the table names: the grammar mask runs on fp32 logits too.
    ``rows`` must be distinct, in-range int64 row indices (the model runner's)."""
    lib = _lib if _loaded else library()
    if lib is None or not logits.is_cpu or logits.dim() != 2 or logits.requires_grad:
        return False
    neg = NEG_INF_BITS.get(logits.dtype)  # signed; the C side keeps the dtype's low bits
    if neg is None or logits.stride(1) != 1 or bitmask.dtype is not torch.int32 or not bitmask.is_cpu:
        return False
    k = bitmask.shape[0]
    if bitmask.dim() != 2 or not bitmask.is_contiguous() or (rows is None and k > logits.shape[0]):
        return False
    if rows is not None and (
        rows.dtype is not torch.int64 or rows.shape != (k,) or not rows.is_contiguous() or not rows.is_cpu
    ):
        return False
    if k == 0:
        return True
    if rows is not None and not (0 <= int(rows.min()) and int(rows.max()) < logits.shape[0]):
        return False
    lib.apply_bitmask(
        logits.data_ptr(), logits.stride(0), logits.element_size(), neg, None if rows is None else rows.data_ptr(),
        k, bitmask.data_ptr(), bitmask.shape[1], logits.shape[1],
    )  # fmt: skip
    return True


def _cache_ok(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> bool:
    """A layer's view [blocks, 2, block_size, Hkv, D] whose inner four dims are contiguous."""
    if kv_cache.dim() != 5 or kv_cache.dtype is not torch.bfloat16 or kv_cache.device.type != "cpu":
        return False
    _, two, bs, hkv, d = kv_cache.shape
    if two != 2 or hkv != num_kv_heads or d != head_dim:
        return False
    return kv_cache.stride()[1:] == (bs * hkv * d, hkv * d, d, 1)


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor | None:
    """Rotate q and k (NeoX halves), store the rotated k and v at ``slot_mapping`` (< 0: skipped)
    and return the rotated q ([n, H, D], new, contiguous), in one call; None when q, k, v are not
    three adjacent views of one fused projection row, or anything else is not for this kernel.
    The caller has checked the indices (``positions_ok``, ``kv_indices_ok``): the C side trusts
    them."""
    lib = _lib if _loaded else library()
    if lib is None or q.dtype is not _BF16 or q.requires_grad or not q.is_cpu or q.dim() != 3:
        return None
    n, nh, d = q.shape
    nkv = k.shape[1]
    width = (nh + 2 * nkv) * d
    row = q.stride(0) if n > 1 else width
    # q, k, v: consecutive head runs of one row (the fused qkv output's split views)
    if (
        n == 0
        or d % 2
        or d > MAX_HEAD_DIM
        or k.shape != (n, nkv, d)
        or v.shape != (n, nkv, d)
        or q.stride()[1:] != (d, 1)
        or k.stride()[1:] != (d, 1)
        or v.stride()[1:] != (d, 1)
        or row < width
        or (n > 1 and (k.stride(0) != row or v.stride(0) != row))
        or k.data_ptr() != q.data_ptr() + nh * d * 2
        or v.data_ptr() != k.data_ptr() + nkv * d * 2
        or k.dtype is not _BF16
        or v.dtype is not _BF16
        or q.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
    ):
        return None
    if (
        positions.dtype is not torch.int64
        or slot_mapping.dtype is not torch.int64
        or positions.shape != (n,)
        or slot_mapping.shape != (n,)
        or (n > 1 and (positions.stride(0) != 1 or slot_mapping.stride(0) != 1))
        or cos_sin_cache.dtype is not torch.float32
        or cos_sin_cache.dim() != 2
        or cos_sin_cache.shape[1] != d
        or not cos_sin_cache.is_contiguous()
        or not _cache_ok(kv_cache, nkv, d)
    ):
        return None
    q_out = torch.empty((n, nh, d), dtype=_BF16)
    lib.rotary_store(
        q.data_ptr(), row, nh, nkv, d, positions.data_ptr(), cos_sin_cache.data_ptr(),
        kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.shape[2], slot_mapping.data_ptr(), n,
        q_out.data_ptr(),
    )  # fmt: skip
    return q_out


def positions_ok(positions: torch.Tensor, num_positions: int) -> bool:
    """Whether every position indexes a row of the cos/sin cache (``rotary_store_kv`` trusts it)."""
    return not positions.numel() or (0 <= int(positions.min()) and int(positions.max()) < num_positions)


def kv_indices_ok(
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int,
    num_blocks: int,
    block_size: int,
    query_start_loc: torch.Tensor | None = None,
) -> bool:
    """Whether a step's slots, lengths, block ids and (given) query starts stay inside the KV
    cache, the block table and the step's tokens (``rotary_store_kv`` and ``attention`` trust
    them). Once per step, ~10 us: a step that fails it takes the torch twins, which raise on a
    bad index."""
    if slot_mapping.numel() and int(slot_mapping.max()) >= num_blocks * block_size:
        return False
    if seq_lens.numel():
        if int(seq_lens.min()) < 0 or int(seq_lens.max()) > max_seq_len:
            return False
        if max_seq_len > block_tables.shape[1] * block_size:
            return False
        used = block_tables[:, : -(-max_seq_len // block_size)]
        if used.numel() and not (0 <= int(used.min()) and int(used.max()) < num_blocks):
            return False
    if query_start_loc is not None:
        if query_start_loc.dtype is not torch.int32 or query_start_loc.shape != (seq_lens.shape[0] + 1,):
            return False
        if int(query_start_loc[0]) != 0 or int(query_start_loc[-1]) != slot_mapping.shape[0]:
            return False
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        if q_lens.numel() and not (bool((q_lens >= 0).all()) and bool((q_lens <= seq_lens).all())):
            return False
    return True


def attention_scores(query_lens: list[int], seq_lens: list[int], num_heads: int) -> int:
    """(query, key) pairs x heads of a causal step: the work ``attention`` is capped by."""
    return num_heads * sum(n * (s - n) + n * (n + 1) // 2 for n, s in zip(query_lens, seq_lens, strict=True))


def attention_simd(enable: bool | None = None) -> bool:
    """Whether ``attention`` takes the AVX2 + FMA kernel (``cpu_attention.c``) where it applies
    (head_dim a multiple of 16); on from the load where the CPU has AVX2 and FMA (a cpuid check,
    so the portable build has it too). ``enable`` False turns it off (the scalar loop), True back
    on where the CPU has it: tests and paired benchmarks compare the two in one process. False
    without the library."""
    lib = library()
    if lib is None:
        return False
    return bool(lib.attention_simd(-1 if enable is None else int(enable)))


def attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    scores: int,
) -> torch.Tensor | None:
    """Causal attention of each request's query tokens over its paged context (this step's K/V
    already stored): q [T, H, D] -> [T, H, D], request b's tokens at rows query_start_loc[b] ..
    query_start_loc[b + 1] - 1, the last of its seq_lens[b] positions (prefill chunks, decode
    rows, mixed). None when not for the native kernel: ``scores`` (``attention_scores``) over
    ``score_cap`` (decode: one query per request), a layout it does not read, ... The caller
    has checked the lengths, starts and block ids (``kv_indices_ok``): the C side trusts them."""
    lib = _lib if _loaded else library()
    if lib is None or q.dtype is not _BF16 or q.requires_grad or not q.is_cpu:
        return None
    if q.dim() != 3 or kv_cache.dim() != 5:
        return None
    tokens, nh, d = q.shape
    batch = seq_lens.shape[0]
    nkv = kv_cache.shape[3]
    if (
        tokens == 0
        or d > MAX_HEAD_DIM
        or scores > score_cap(tokens == batch)
        or nh % nkv
        or nh // nkv > MAX_HEADS_PER_KV
        or not q.is_contiguous()
        or not _cache_ok(kv_cache, nkv, d)
        or block_tables.dtype is not torch.int32
        or seq_lens.dtype is not torch.int32
        or query_start_loc.dtype is not torch.int32
        or block_tables.dim() != 2
        or block_tables.shape[0] != batch
        or block_tables.stride(1) != 1
        or query_start_loc.shape != (batch + 1,)
        or not query_start_loc.is_contiguous()
        or (batch > 1 and seq_lens.stride(0) != 1)
        or block_tables.shape[1] * kv_cache.shape[2] < max_seq_len
    ):
        return None
    out = torch.empty((tokens, nh, d), dtype=_BF16)
    lib.attention(
        q.data_ptr(), kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.shape[2], nkv, d,
        block_tables.data_ptr(), block_tables.stride(0), query_start_loc.data_ptr(), seq_lens.data_ptr(),
        batch, nh, scale, out.data_ptr(),
    )  # fmt: skip
    return out
