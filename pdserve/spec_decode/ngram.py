"""Prompt lookup (n-gram) drafting: no weights, nothing from a prefill node.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``: the request's last n tokens are
looked up in its earlier tokens (prompt and output); at the latest earlier occurrence, the k
tokens that followed it are the draft. The first n that matches wins (longer context first).

    tokens:  a b c d x y a b c  ?        suffix n=3 "a b c" occurs at 0; it was followed by
                                         "d x y" -> draft [d, x, y] (k = 3)
"""

from __future__ import annotations

import numpy as np

from pdserve.spec_decode.config import SpeculativeConfig


class NgramProposer:
    """Stateless; one per engine."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.k = config.num_speculative_tokens

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to ``min(k, max_drafts)`` draft tokens following ``token_ids`` ([] if no match)."""
        k = min(self.k, max_drafts)
        num = len(token_ids)
        if k <= 0 or num < self.min_n + 1:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            suffix = arr[num - n :]
            # Windows starting at 0 .. num - n - 1 (the suffix itself excluded).
            windows = np.lib.stride_tricks.sliding_window_view(arr[: num - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                # The latest occurrence followed by k tokens (the most recent continuation that
                # fills the draft), else the earliest (the longest continuation there is).
                full = hits[hits + n + k <= num]
                start = int(full[-1] if full.size else hits[0]) + n
                return [int(t) for t in arr[start : start + k]]
        return []
