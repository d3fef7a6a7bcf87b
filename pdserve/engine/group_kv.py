"""KV tensors of KV cache groups that have block tables of their own, and each step's
attention metadata per group (the model runner's side of engine/kv_group_tables.py).

One tensor per group, holding only that group's layers, in the runner's block layout:

    attention group:    [num_blocks_g, num_local_layers_g, 2, block_size, num_kv_heads / tp, head_dim]
    short-convolution:  [num_blocks_g, num_local_layers_g, block_size, hidden_size]  (its inputs)

Group 0's tensor is the runner's ``kv_cache``; ``layer_caches[i]`` is local layer i's view of
its group's tensor. A step's metadata for group g shares group 0's per-request tensors (query
starts, sequence lengths) and has its own ``slot_mapping`` and ``block_tables``, built from the
chunks' ``group_block_ids``; ``AttentionMetadata.for_layer`` hands each layer its group's.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

import torch

from pdserve.engine.host_batch import HostBatch, PinnedStaging, extend_slots
from pdserve.engine.kv_cache_groups import SHORT_CONV, KVCacheGroupSpec
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.models.attention import AttentionMetadata


def group_block_shapes(
    specs: Sequence[KVCacheGroupSpec], num_kv_heads: int, head_dim: int, hidden_size: int
) -> list[tuple[int, ...]]:
    """One layer's block in each group: K and V of ``block_size`` positions, or a short
    convolution's inputs of those positions."""
    return [
        (s.block_size, hidden_size) if s.kind == SHORT_CONV else (2, s.block_size, num_kv_heads, head_dim)
        for s in specs
    ]


class GroupKV:
    def __init__(
        self,
        layer_names: Sequence[str],
        specs: Sequence[KVCacheGroupSpec],
        num_blocks: Sequence[int],
        block_shapes: Sequence[tuple[int, ...]],  # group_block_shapes
        make_tensor: Callable[[tuple[int, ...]], torch.Tensor],  # zero-filled, the cache's dtype
    ) -> None:
        assert len(specs) == len(num_blocks) == len(block_shapes) > 1
        assert len({s.block_size for s in specs}) == 1
        self.block_size = specs[0].block_size
        self.tensors: list[torch.Tensor] = []
        caches: list[torch.Tensor | None] = [None] * len(layer_names)
        self.layer_group = [0] * len(layer_names)
        for g, (spec, n, shape) in enumerate(zip(specs, num_blocks, block_shapes, strict=True)):
            local = [i for i, name in enumerate(layer_names) if name in spec.layer_names]
            t = make_tensor((n, len(local), *shape))
            self.tensors.append(t)
            for j, i in enumerate(local):
                caches[i] = t[:, j]  # [num_blocks_g, *shape]
                self.layer_group[i] = g
        missing = [layer_names[i] for i, c in enumerate(caches) if c is None]
        assert not missing, f"layers in no KV group: {missing}"
        self.layer_caches: list[torch.Tensor] = [c for c in caches if c is not None]

    def attach(
        self, meta: AttentionMetadata, sched: SchedulerOutput, batch: HostBatch, staging: PinnedStaging
    ) -> None:
        """Give ``meta`` (group 0's, built for ``batch``) every layer's metadata for this step."""
        bs = self.block_size
        metas = [meta]
        for g in range(1, len(self.tensors)):
            tables = [c.group_block_ids[g - 1] for c in sched.chunks]
            width = max(len(t) for t in tables)
            slots, flat = array("q"), array("i")
            for c, ids in zip(sched.chunks, tables, strict=True):
                extend_slots(slots, ids, c.start_pos, c.start_pos + c.num_tokens, bs)
                flat.extend(ids)
                flat.frombytes(bytes(4 * (width - len(ids))))  # padded with block 0 (the null block)
            metas.append(
                AttentionMetadata(
                    num_tokens=meta.num_tokens,
                    slot_mapping=staging.to_device(slots, torch.int64),
                    query_start_loc=meta.query_start_loc,
                    seq_lens=meta.seq_lens,
                    block_tables=staging.to_device(flat, torch.int32).view(batch.num_seqs, width),
                    query_lens_cpu=meta.query_lens_cpu,
                    seq_lens_cpu=meta.seq_lens_cpu,
                    max_query_len=meta.max_query_len,
                    max_seq_len=meta.max_seq_len,
                    block_size=bs,
                    backend=meta.backend,
                )
            )
        meta.layer_metas = [metas[g] for g in self.layer_group]
