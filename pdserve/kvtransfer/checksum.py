"""Optional per-transfer checksum (docs/design.md §3 "Transfers carry a checksum when enabled").

Prefill digests the KV blocks it is about to push (whole blocks: a push copies whole blocks),
decode digests the blocks it received; a mismatch fails the pull and ``kv_load_failure_policy``
applies. blake2b-128 over the raw bytes: catches corruption and mis-addressed writes, not an
adversary. Valid when both sides hold the same layers in the same layout (the handshake's compat
hash checks that); a D stage of a different PP size, which receives a slice of the layers, would
need a digest per layer range (not built: multi-stage nodes are not in this tree yet).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any


def kv_blocks_digest(kv_cache: Any, block_ids: Sequence[int]) -> bytes:
    """Digest of the KV cache rows ``block_ids`` ([num_blocks, ...] tensor), in that order."""
    import torch

    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv_cache.device)
    rows = kv_cache.index_select(0, idx).contiguous().view(torch.uint8).cpu().numpy()
    return hashlib.blake2b(rows.tobytes(), digest_size=16).digest()
