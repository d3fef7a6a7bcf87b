"""Storing a step's new K and V in the paged KV cache (layout: pdserve/models/attention.py), with
the rotation of q and k that precedes it in every attention layer.

``rotary_and_store_kv`` is what a layer calls (llama.py, lfm2.py, gemma3.py): one Triton launch
on the Triton path, one native CPU call where ``kernels.cpu_native_attention`` takes the step, else the
torch twins. ``store_kv`` stores without rotating (``paged_attention``); ``write_kv_cache`` is
the torch store alone. ``native_kv_ok`` is the once-per-step bounds check the native CPU
kernels rely on, for the store here and the attention (attention_torch.py).
"""

from __future__ import annotations

import torch

from pdserve import kernels
from pdserve.kernels import cpu_native_attention
from pdserve.models.attention import AttentionMetadata
from pdserve.models.attention_backend import triton_kv_write_impl


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


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """The new tokens' K/V into their slots, by the metadata's attention path."""
    if meta.backend == "triton":
        triton_kv_write_impl().write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        return
    if meta._store_index is None:  # once per step: every layer stores to the same slots
        meta._store_index = _slot_index(meta.slot_mapping, kv_cache.shape[2])
    _write_kv(k, v, kv_cache, meta._store_index)


def native_kv_ok(meta: AttentionMetadata, kv_cache: torch.Tensor) -> bool:
    """``cpu_native_attention.kv_indices_ok`` for this step: computed by its first layer, kept for
    the rest."""
    ok = meta._native_kv_ok
    num_blocks = kv_cache.shape[0]
    if ok is None or ok[0] != num_blocks:
        passed = cpu_native_attention.kv_indices_ok(
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
    """``cpu_native_attention.positions_ok`` for this step's positions, likewise once per step."""
    ok = meta._native_pos_ok
    if ok is None or ok[0] is not positions or ok[1] is not cos_sin_cache:
        ok = meta._native_pos_ok = (
            positions,
            cos_sin_cache,
            cpu_native_attention.positions_ok(positions, cos_sin_cache.shape[0]),
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
        and native_kv_ok(meta, kv_cache)
    ):
        q_rot = cpu_native_attention.rotary_store_kv(
            q, k, v, positions, cos_sin_cache, kv_cache, meta.slot_mapping
        )
        if q_rot is not None:
            return _exchanged(q_rot, kv_cache, meta)
    if kernels.wants_triton(q):
        q, k = kernels.apply_rotary(q, k, positions, cos_sin_cache)
    else:  # the torch twin, its cos / sin gathered once per step
        rot = meta._rotary
        if rot is None or rot[0] is not positions or rot[1] is not cos_sin_cache:
            rot = meta._rotary = (positions, cos_sin_cache, *kernels.rotary_cos_sin(positions, cos_sin_cache))
        q, k = kernels.rotate_qk_torch(q, k, rot[2], rot[3])
    store_kv(k, v, kv_cache, meta)
    if k_out is not None:
        k_out.copy_(k)
    return _exchanged(q, kv_cache, meta)


def _exchanged(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """This step's local K/V are stored; under prefill context parallelism (``meta.kv_exchange``)
    the other ranks' K/V of the step are stored next, so attention reads the whole chunk. Returns q."""
    if meta.kv_exchange is not None:
        meta.kv_exchange(kv_cache)
    return q
