"""Paged attention's metadata: ``AttentionMetadata``, built by the model runner each step, and
the KV cache layout every attention path reads and writes.

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

A slot < 0 in ``slot_mapping`` marks a padding token (a CUDA-graph batch padded up to its
captured size): its K/V is not stored, and a request with seq_len 0 attends to nothing.

The code that reads and writes the cache, per layer:

    attention_backend.py   select_attention_backend: the path a runner takes (``backend`` below)
    kv_store.py            rotary_and_store_kv, write_kv_cache: the step's new K/V into the cache
    paged_attention.py     attend_cached, paged_attention: attention over the cache, by path
    attention_torch.py     the torch path (gather the context, SDPA; native CPU kernels)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

AttentionBackend = Literal["torch", "triton"]  # chosen per runner: attention_backend.py


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
    # Native CPU kernels (kernels.cpu_native_attention), per step: whether the step's slots, lengths and
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
