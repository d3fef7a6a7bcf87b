"""Paged attention: metadata built by the model runner, and the torch path.

KV cache layout (fixed; the transfer code relies on it):

    whole stage cache: [num_blocks, num_local_layers, 2, block_size, num_kv_heads, head_dim]
    one layer's view:  kv_cache[:, i]  -> [num_blocks, 2, block_size, num_kv_heads, head_dim]
                       (index 0 = K, 1 = V; the view is non-contiguous in dim 0)

One block holds every local layer's K and V for ``block_size`` positions, so a run of
consecutive blocks is one contiguous byte range for all layers (few, large transfer descriptors).

Tokens of a step are laid out request after request:

    query tokens : | req0: q0 tokens | req1: q1 tokens | ... |      query_start_loc = [0, q0, q0+q1, ...]
    req i context: positions [seq_lens[i] - q_i, seq_lens[i])  are the new tokens; earlier ones
                   are already in the cache (computed earlier, prefix hit or remote KV).

Two implementations, picked once per runner by ``select_attention_backend`` (the one predicate,
``triton_attention_unsupported_reason``, of what the Triton kernels can compute) and carried in
``AttentionMetadata.backend``, so metadata building and execution agree:

    kernels backend   device          -> attention path
    ---------------   -------------   --------------------------------------------------------
    auto              CPU             torch (gather the context, SDPA)
    auto              CUDA            Triton (pdserve.kernels.triton_attention); unsupported: raise
                                      (prefill steps of fresh prompts: cuDNN, cudnn_prefill.py;
                                      small prefill steps: FA2 varlen, flash_prefill.py)
    triton            any             Triton (CPU needs TRITON_INTERPRET=1); unsupported: raise
    torch             any             torch

A slot < 0 in ``slot_mapping`` marks a padding token (a CUDA-graph batch padded up to its
captured size): its K/V is not stored, and a request with seq_len 0 attends to nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Literal

import torch
import torch.nn.functional as F

from pdserve import kernels
from pdserve.errors import UnsupportedError
from pdserve.kernels import cpu_native
from pdserve.kernels.backend import HALF_DTYPES
from pdserve.models import cudnn_prefill, flash_prefill

AttentionBackend = Literal["torch", "triton"]
TRITON_ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_triton_impl: ModuleType | None = None
_sm_counts: dict[torch.device, int] = {}


@dataclass
class AttentionMetadata:
    num_tokens: int  # total query tokens this step
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset for each new token's K/V
    query_start_loc: torch.Tensor  # [batch + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [batch] int32: context length after this step (computed + new)
    block_tables: torch.Tensor  # [batch, max_blocks_per_seq] int32, padded with 0
    query_lens_cpu: list[int]  # same as diff(query_start_loc), on the host
    seq_lens_cpu: list[int]  # same as seq_lens, on the host
    max_query_len: int
    max_seq_len: int
    block_size: int
    backend: AttentionBackend = "torch"  # from select_attention_backend, fixed per runner
    # Captured for a CUDA graph: the host-side lens are static upper bounds (max_seq_len =
    # max_model_len, query lens 1), not this step's values; only the device tensors are current.
    static_bounds: bool = False
    # Torch path: the context gather index, built by the first layer of a step, reused by the rest.
    # Whoever refills a metadata's tensors in place (static CUDA-graph buffers) calls refilled().
    _ctx_index: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    # Flash prefill path (flash_prefill.py): each key's block and offset, cumulative key counts.
    _flash_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    # cuDNN prefill path (cudnn_prefill.py): its split of the step into fresh and other rows.
    _dense_plan: object | None = field(default=None, repr=False)
    # Torch path, per step like _ctx_index: the new tokens' (block ids, offsets, kept rows) for the
    # KV store, and (positions, cos_sin_cache, cos, sin) for the rotation (the same in every layer).
    _store_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = field(
        default=None, repr=False
    )
    _rotary: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = field(
        default=None, repr=False
    )
    # Native CPU kernels (kernels.cpu_native), per step: whether the step's slots, lengths and
    # block ids passed the bounds check those kernels rely on (for a cache of that many blocks),
    # and whether its positions did (for those positions and that cos/sin cache).
    _native_kv_ok: tuple[int, bool] | None = field(default=None, repr=False)
    _native_pos_ok: tuple[torch.Tensor, torch.Tensor, bool] | None = field(default=None, repr=False)
    # KV cache groups with block tables of their own (engine/group_kv.py): local layer i reads
    # layer_metas[i] (its group's slot_mapping and block_tables); None: every layer reads this one.
    layer_metas: list[AttentionMetadata] | None = field(default=None, repr=False)
    # Prefill context parallelism (pdserve/pcp): called with each layer's cache view once the
    # step's local K/V are stored, it writes the other ranks' K/V of the step there; None: no split.
    kv_exchange: Callable[[torch.Tensor], None] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    def for_layer(self, local_layer: int) -> AttentionMetadata:
        """The metadata local layer ``local_layer`` attends with (its KV group's block table)."""
        return self if self.layer_metas is None else self.layer_metas[local_layer]

    def refilled(self) -> None:
        """The device tensors were overwritten in place for a new step: drop derived caches."""
        self._ctx_index = None
        self._flash_index = None
        self._dense_plan = None
        self._store_index = None
        self._rotary = None
        self._native_kv_ok = None
        self._native_pos_ok = None


# ----------------------------------------------------------------------------- backend choice


def triton_attention_unsupported_reason(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> str | None:
    """Why the Triton attention kernels cannot compute this case, or None if they can."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"device {device} needs CUDA, or TRITON_INTERPRET=1 set before importing triton"
    if dtype not in TRITON_ATTENTION_DTYPES:
        return f"dtype {dtype} is not one of fp16/bf16/fp32"
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"{num_heads} query heads do not split evenly over {num_kv_heads} KV heads"
    if num_heads // num_kv_heads > 64:
        return f"{num_heads // num_kv_heads} query heads per KV head exceed 64 (one tile)"
    if not 0 < head_dim <= 256:
        return f"head_dim {head_dim} is outside 1..256"
    return None


def select_attention_backend(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> AttentionBackend:
    """The attention path for a runner, following the process-wide ``pdserve.kernels`` backend."""
    backend = kernels.get_backend()
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return "torch"
    reason = triton_attention_unsupported_reason(device, dtype, num_heads, num_kv_heads, head_dim)
    if reason is not None:
        raise UnsupportedError(
            f"no Triton paged-attention kernel for {num_heads} heads / {num_kv_heads} KV heads, "
            f"head_dim {head_dim}, {dtype} on {device}: {reason}; use the torch backend "
            "(pdserve.kernels.set_backend('torch')) or a supported model/dtype"
        )
    return "triton"


def _triton() -> ModuleType:
    global _triton_impl
    if _triton_impl is None:
        from pdserve.kernels import triton_attention

        _triton_impl = triton_attention
    return _triton_impl


def _sm_count(device: torch.device) -> int:
    if device not in _sm_counts:
        _sm_counts[device] = _triton().device_sm_count(device)
    return _sm_counts[device]


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' K/V at their slots (slots < 0: padding, skipped). Mutates ``kv_cache``
    (a layer view) in place. Torch path; data-dependent when padding is present (no CUDA graph)."""
    _write_kv(k, v, kv_cache, _slot_index(slot_mapping, kv_cache.shape[2]))


def _slot_index(
    slot_mapping: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(block ids, offsets) of the non-padding slots, and which rows those are (None: all)."""
    keep = None
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping = slot_mapping[keep]
    return slot_mapping // block_size, slot_mapping % block_size, keep


def _write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
) -> None:
    block_ids, offsets, keep = index
    if keep is not None:
        k, v = k[keep], v[keep]
    # Index the K and V halves separately: each is still a view of the stage cache, so index_put_
    # writes through to it even though the layer view is non-contiguous in dim 0.
    kv_cache[:, 0][block_ids, offsets] = k
    kv_cache[:, 1][block_ids, offsets] = v


def _context_index(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks holding each request's context, and which of their slots are keys; computed
    once per step for all layers.

    Returns (block ids [B * nb], key_valid [B, nb * block_size]) with nb = ceil(max_seq_len /
    block_size). Slots past a request's seq_len (its last block's tail, padding blocks of the
    block table) are gathered but masked out.
    """
    cached = meta._ctx_index
    if cached is not None:
        return cached
    nb = -(-meta.max_seq_len // block_size)
    assert meta.block_tables.shape[1] >= nb, "block_tables too narrow for max_seq_len"
    blocks = meta.block_tables[:, :nb].reshape(-1).long()  # [B * nb]
    pos = torch.arange(nb * block_size, device=blocks.device)  # [nb * block_size]
    key_valid = pos[None, :] < meta.seq_lens[:, None]  # [B, nb * block_size]
    meta._ctx_index = (blocks, key_valid)
    return meta._ctx_index


def _gather_context(
    kv_cache: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K, V of every request's whole context in SDPA layout [B, Hkv, nb * block_size, D], and
    the key-validity mask [B, nb * block_size].

    Whole blocks are gathered with one index_select (row copies, about twice as fast on CPU as
    gathering single positions), then K and V are split out of each block.
    """
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    blocks, key_valid = _context_index(meta, block_size)
    batch = key_valid.shape[0]
    g = kv_cache.index_select(0, blocks).view(batch, -1, 2, block_size, num_kv_heads, head_dim)
    seq = g.shape[1] * block_size
    key = g[:, :, 0].reshape(batch, seq, num_kv_heads, head_dim)  # [B, S, Hkv, D]
    value = g[:, :, 1].reshape(batch, seq, num_kv_heads, head_dim)
    return key.transpose(1, 2), value.transpose(1, 2), key_valid


def _store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """The new tokens' K/V into their slots, by the metadata's attention path."""
    if meta.backend == "triton":
        _triton().write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        return
    if meta._store_index is None:  # once per step: every layer stores to the same slots
        meta._store_index = _slot_index(meta.slot_mapping, kv_cache.shape[2])
    _write_kv(k, v, kv_cache, meta._store_index)


def _native_kv_ok(meta: AttentionMetadata, kv_cache: torch.Tensor) -> bool:
    """``cpu_native.kv_indices_ok`` for this step: computed by its first layer, kept for the rest."""
    ok = meta._native_kv_ok
    num_blocks = kv_cache.shape[0]
    if ok is None or ok[0] != num_blocks:
        passed = cpu_native.kv_indices_ok(
            meta.slot_mapping,
            meta.seq_lens,
            meta.block_tables,
            meta.max_seq_len,
            num_blocks,
            kv_cache.shape[2],
            meta.query_start_loc,
        )
        ok = meta._native_kv_ok = (num_blocks, passed)
    return ok[1]


def _native_positions_ok(
    meta: AttentionMetadata, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> bool:
    """``cpu_native.positions_ok`` for this step's positions, likewise once per step."""
    ok = meta._native_pos_ok
    if ok is None or ok[0] is not positions or ok[1] is not cos_sin_cache:
        ok = meta._native_pos_ok = (
            positions,
            cos_sin_cache,
            cpu_native.positions_ok(positions, cos_sin_cache.shape[0]),
        )
    return ok[2]


def rotary_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    k_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k by position, store the new tokens' rotated K and V in the cache; return q.
    ``k_out`` ([n, Hkv, D], contiguous): the rotated k is also written there (cudnn_prefill).

    ``kernels.apply_rotary`` followed by ``write_kv_cache``. On the Triton path this is one launch
    (``triton_rotary.rotary_store_kv_fwd``): the KV store rides along with the rotation.
    q: [n, H, D], k, v: [n, Hkv, D] (views of the fused qkv output are fine); kv_cache: one
    layer's view. Returns the rotated q, [n, H, D] contiguous. Under prefill context parallelism
    the other ranks' K/V of the step are stored too (``_exchanged``).
    """
    if meta.backend == "triton" and kernels.rotary_can_run(q, k, positions, cos_sin_cache):
        from pdserve.kernels import triton_rotary

        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        q_out = triton_rotary.rotary_store_kv_fwd(
            q, k, v, positions, cos_sin_cache.contiguous(), kv_cache, meta.slot_mapping, k_out
        )
        return _exchanged(q_out, kv_cache, meta)
    if (
        k_out is None
        and kernels.wants_native(q)
        and _native_positions_ok(meta, positions, cos_sin_cache)
        and _native_kv_ok(meta, kv_cache)
    ):
        q_rot = cpu_native.rotary_store_kv(q, k, v, positions, cos_sin_cache, kv_cache, meta.slot_mapping)
        if q_rot is not None:
            return _exchanged(q_rot, kv_cache, meta)
    if kernels.wants_triton(q):
        q, k = kernels.apply_rotary(q, k, positions, cos_sin_cache)
    else:  # the torch twin, its cos / sin gathered once per step
        rot = meta._rotary
        if rot is None or rot[0] is not positions or rot[1] is not cos_sin_cache:
            rot = meta._rotary = (positions, cos_sin_cache, *kernels.rotary_cos_sin(positions, cos_sin_cache))
        q, k = kernels.rotate_qk_torch(q, k, rot[2], rot[3])
    _store_kv(k, v, kv_cache, meta)
    if k_out is not None:
        k_out.copy_(k)
    return _exchanged(q, kv_cache, meta)


def _exchanged(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """This step's local K/V are stored; under prefill context parallelism (``meta.kv_exchange``)
    the other ranks' K/V of the step are stored next, so attention reads the whole chunk. Returns q."""
    if meta.kv_exchange is not None:
        meta.kv_exchange(kv_cache)
    return q


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write the new K/V into the cache, then causal attention over each request's whole context.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    kv_cache: one layer's view [num_blocks, 2, block_size, num_kv_heads, head_dim].
    Query i of request r sits at absolute position ``seq_len_r - q_len_r + i`` and sees keys at
    positions <= its own. Returns [num_tokens, num_heads, head_dim] in q.dtype.
    """
    num_tokens, _, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), f"k {tuple(k.shape)}"
    assert kv_cache.dtype == k.dtype, f"kv_cache {kv_cache.dtype} vs k {k.dtype}"
    _store_kv(k, v, kv_cache, meta)
    return attend_cached(q, kv_cache, meta, scale)


def attend_cached(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's query tokens over its paged context, this step's K/V
    already stored (``paged_attention`` without the write). Same shapes as ``paged_attention``.
    ``k``, ``v``: optionally this step's rotated keys and values in token order ([n, Hkv, D]),
    which the cuDNN prefill path reads instead of gathering them from the cache."""
    if meta.backend == "triton":
        # prefill steps: cuDNN for fresh prompts, else flash for small steps (None: not for it)
        out = cudnn_prefill.attend(q, kv_cache, meta, scale, k, v)
        if out is None:
            out = flash_prefill.attend(q, kv_cache, meta, scale)
        return out if out is not None else _attend_triton(q, kv_cache, meta, scale)
    assert meta.backend == "torch", f"attention backend {meta.backend!r}"
    num_tokens, num_heads, head_dim = q.shape
    _, two, _, num_kv_heads, cache_head_dim = kv_cache.shape
    assert two == 2 and cache_head_dim == head_dim, f"kv_cache shape {tuple(kv_cache.shape)}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads over {num_kv_heads} kv heads"
    assert meta.num_tokens == num_tokens and meta.slot_mapping.shape == (num_tokens,)

    batch = meta.batch_size
    if kernels.wants_native(q) and not meta.static_bounds and _native_kv_ok(meta, kv_cache):
        # prefill, decode and mixed steps alike, under the kernel's cap on work
        if meta.max_query_len == 1:
            scores = num_heads * batch * meta.max_seq_len  # a bound, cheaper than the sum
        else:
            scores = cpu_native.attention_scores(meta.query_lens_cpu, meta.seq_lens_cpu, num_heads)
        out = cpu_native.attention(
            q,
            kv_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            meta.max_seq_len,
            scale,
            scores,
        )
        if out is not None:
            return out
    if batch == 1 and q.dtype in HALF_DTYPES and q.device.type == "cpu" and not meta.static_bounds:
        out = _one_request_attention(q, kv_cache, meta, scale)
        if out is not None:
            return out
    key, value, key_valid = _gather_context(kv_cache, meta)

    if meta.max_query_len == 1:
        assert num_tokens == batch
        return _decode_attention(q, key, value, key_valid, num_kv_heads, scale)

    # Mixed batch. Decode rows (one query) take the grouped path; only the prefill rows are
    # padded to the longest query, so a prefill chunk beside many decodes costs what it costs.
    qlens = meta.query_lens_cpu
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    dec = [i for i, n in enumerate(qlens) if n == 1]
    pre = [i for i, n in enumerate(qlens) if n != 1]
    device = q.device
    out = q.new_empty(num_tokens, num_heads, head_dim)
    if dec:
        rows = torch.tensor(dec, device=device)
        tok = torch.tensor([starts[i] for i in dec], device=device)
        out[tok] = _decode_attention(q[tok], key[rows], value[rows], key_valid[rows], num_kv_heads, scale)
    rows = torch.tensor(pre, device=device)
    tok = torch.tensor([t for i in pre for t in range(starts[i], starts[i + 1])], device=device)
    out[tok] = _padded_attention(
        q[tok], key[rows], value[rows], [qlens[i] for i in pre], [meta.seq_lens_cpu[i] for i in pre], scale
    )
    return out


# CPU bf16 decode: below this many (request, KV head) pairs SDPA's kernel is as fast or faster
EAGER_BF16_MIN_ROWS = 8


def _one_request_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor | None:
    """A step of one request on the CPU in half precision, when it is a decode step that would
    take SDPA anyway (fewer KV heads than ``EAGER_BF16_MIN_ROWS``) or a fresh prompt: its keys
    cut to its length instead of masked, a fresh prompt as one causal call, so none of the
    general path's padding and mask building (a 48-token prompt of the tiny bench model: ~150 µs
    a layer less; docs/benchmarks.md, "The CPU decode step"). Returns None for any other step (a chunk
    after cached context): the general path takes it. The same attention as the general path,
    but not always the same bits: SDPA's kernel splits a shorter key run differently (the bench
    model's greedy tokens part at token 74 of 128). fp32 keeps the general path, the one the
    token-identity tests hold; the CPU half-precision path is not token-identical to
    ``transformers`` either way."""
    q_len, seq_len = meta.query_lens_cpu[0], meta.seq_lens_cpu[0]
    _, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if not (q_len == 1 and num_kv_heads < EAGER_BF16_MIN_ROWS) and q_len != seq_len:
        return None
    key, value, _ = _gather_context(kv_cache, meta)  # [1, Hkv, S >= seq_len, D]
    key, value = key[:, :, :seq_len], value[:, :, :seq_len]
    if q_len == 1:
        q_grouped = q.reshape(1, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [1, Hkv, G, D]
        out = F.scaled_dot_product_attention(q_grouped, key, value, scale=scale)
        return out.reshape(1, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, H, L, D]
        key,
        value,
        is_causal=True,  # L queries over L keys: query i sees keys 0..i
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out[0].transpose(0, 1)  # [L, H, D]


def _decode_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_valid: torch.Tensor,
    num_kv_heads: int,
    scale: float,
) -> torch.Tensor:
    """One query per request: the ``group`` query heads that share a KV head stand in as SDPA's
    query axis; no padding and no causal mask beyond key validity.

    q: [B, H, D]; key, value: [B, Hkv, max_seq, D]; key_valid: [B, max_seq] -> [B, H, D].
    """
    batch, num_heads, head_dim = q.shape
    q_grouped = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and batch * num_kv_heads >= EAGER_BF16_MIN_ROWS:
        # transformers' eager attention (bf16 matmuls, fp32 softmax): on the CPU, SDPA's bf16 kernels
        # cost 2.7x this at 16 single-query rows and 5x at 64 (docs/benchmarks.md, "The CPU decode step")
        scores = torch.matmul(q_grouped, key.transpose(-1, -2)).float()  # [B, Hkv, G, S]
        scores.masked_fill_(~key_valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores.mul_(scale), dim=-1).to(q.dtype)
        return torch.matmul(probs, value).reshape(batch, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q_grouped, key, value, attn_mask=key_valid[:, None, None, :], scale=scale
    )
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)  # [B, H, D]


def attend_cached_window(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int
) -> torch.Tensor:
    """``attend_cached`` of a sliding-window layer: a query at position p sees keys at positions
    (p - window, p] (transformers' ``sliding_window_overlay``). Torch path only."""
    if meta.backend != "torch":
        raise UnsupportedError(
            f"sliding-window attention has no {meta.backend} kernel; use the torch backend "
            "(pdserve.kernels.set_backend('torch'))"
        )
    key, value, _ = _gather_context(kv_cache, meta)
    return _padded_attention(q, key, value, meta.query_lens_cpu, meta.seq_lens_cpu, scale, window)


def _padded_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of several requests' query runs, padded to the longest.

    q: [sum(query_lens), H, D] request after request; key, value: [B, Hkv, max_seq, D].
    Query i of request r sits at absolute position seq_len_r - q_len_r + i; with ``window`` it
    sees only the keys of the last ``window`` positions up to its own.
    """
    num_tokens, num_heads, head_dim = q.shape
    batch, num_kv_heads, max_seq, _ = key.shape
    device = q.device
    max_q = max(query_lens)
    qlens_t = torch.tensor(query_lens, device=device)
    starts = torch.cumsum(qlens_t, 0) - qlens_t  # [B]
    #   token t  ->  (batch_idx[t], pos_idx[t]) in the padded [B, max_q] grid
    batch_idx = torch.repeat_interleave(torch.arange(batch, device=device), qlens_t, output_size=num_tokens)
    pos_idx = torch.arange(num_tokens, device=device) - starts[batch_idx]  # [num_tokens]
    q_padded = q.new_zeros(batch, max_q, num_heads, head_dim)
    q_padded[batch_idx, pos_idx] = q
    # Padded query rows continue past seq_len_r; they see >= 1 key, so never give NaN, and are dropped.
    q_abs = (torch.tensor(seq_lens, device=device) - qlens_t)[:, None] + torch.arange(max_q, device=device)
    mask = torch.arange(max_seq, device=device)[None, None, :] <= q_abs[:, :, None]  # [B, max_q, max_seq]
    if window is not None:
        mask &= torch.arange(max_seq, device=device)[None, None, :] > q_abs[:, :, None] - window
    out = F.scaled_dot_product_attention(
        q_padded.transpose(1, 2),  # [B, H, max_q, D]
        key,
        value,
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [B, H, max_q, D]
    return out.transpose(1, 2)[batch_idx, pos_idx].to(q.dtype)  # [num_tokens, H, D]


def _attend_triton(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """The Triton path: one attention launch (plus a merge when split).

    Reads only device tensors and launch-shape values (num_tokens, batch size, max_query_len as
    decode-or-not), so it is safe inside a CUDA graph whose metadata holds static bounds.
    """
    num_tokens = q.shape[0]
    num_kv_heads = kv_cache.shape[3]
    assert meta.num_tokens == num_tokens and meta.slot_mapping.shape == (num_tokens,)
    impl = _triton()
    batch = meta.batch_size
    splits = 1
    if meta.max_query_len == 1:  # tile shape only; the kernel is the same for every query length
        splits = impl.num_kv_splits(batch, num_kv_heads, _sm_count(q.device))
    return impl.paged_attention(
        q,
        kv_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_query_len,
        scale,
        splits,
    )
