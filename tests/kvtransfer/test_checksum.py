"""The per-transfer KV digest sees every byte of the blocks, in block order."""

from __future__ import annotations

import torch

from pdserve.kvtransfer.checksum import kv_blocks_digest


def test_digest_changes_with_any_byte_and_with_block_order() -> None:
    cache = torch.randn(8, 2, 2, 4, 2, 16)
    d = kv_blocks_digest(cache, [1, 2, 5])
    assert d == kv_blocks_digest(cache.clone(), [1, 2, 5]) and len(d) == 16
    assert d != kv_blocks_digest(cache, [2, 1, 5])
    other = cache.clone()
    other[5, 1, 1, 3, 1, 15] += 1e-3  # one element of the last block's last layer
    assert d != kv_blocks_digest(other, [1, 2, 5])
    other[0] += 1.0  # a block outside the transfer does not matter
    assert kv_blocks_digest(cache, [1, 2]) == kv_blocks_digest(cache.clone(), [1, 2])
