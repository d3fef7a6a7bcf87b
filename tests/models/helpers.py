"""Hand-built attention metadata and caches for model tests (the model runner builds the real ones)."""

from __future__ import annotations

import torch

from pdserve.models.attention import AttentionMetadata


def build_metadata(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
) -> AttentionMetadata:
    """Metadata for one step: request i adds ``query_lens[i]`` tokens ending at ``seq_lens[i]``.

    ``block_tables[i]`` must cover ``seq_lens[i]`` positions; rows are padded with block 0.
    """
    assert len(query_lens) == len(seq_lens) == len(block_tables)
    slots: list[int] = []
    for q_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        assert len(table) * block_size >= seq_len, "block table too short"
        for pos in range(seq_len - q_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        num_tokens=starts[-1],
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )


def allocate_kv_cache(
    num_blocks: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A whole stage cache filled with huge finite garbage, so reads of never-written slots that
    the mask fails to exclude show up in the outputs (the runner's cache is zero-initialised, so
    slots are always finite)."""
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    return torch.full(shape, 3e4, dtype=dtype)
