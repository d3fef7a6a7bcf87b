"""Prompt lookup (n-gram) drafting: no weights, nothing from a prefill node.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``: the request's last n tokens are
looked up in its earlier tokens (prompt and output); at the latest earlier occurrence, the k
tokens that followed it are the draft. The first n that matches wins (longer context first).

    tokens:  a b c d x y a b c  ?        suffix n=3 "a b c" occurs at 0; it was followed by
                                         "d x y" -> draft [d, x, y] (k = 3)
"""

from __future__ import annotations

from pdserve.config.speculative import SpeculativeConfig


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
        toks, last, max_n = token_ids, token_ids[-1], min(self.max_n, num - 1)
        # Earlier positions holding the last token (list.index: a C scan), then how far back
        # each match runs, up to max_n: a few comparisons per candidate.
        ends: list[int] = []
        lens: list[int] = []
        i = -1
        while True:
            try:
                i = toks.index(last, i + 1, num - 1)
            except ValueError:
                break
            n = 1
            while n < max_n and i - n >= 0 and toks[i - n] == toks[num - 1 - n]:
                n += 1
            ends.append(i)
            lens.append(n)
        for n in range(max_n, self.min_n - 1, -1):
            hits = [e for e, m in zip(ends, lens, strict=True) if m >= n]  # the n-gram ends there
            if hits:
                # The latest occurrence followed by k tokens (the most recent continuation that
                # fills the draft), else the earliest (the longest continuation there is).
                full = [e for e in hits if e + 1 + k <= num]
                begin = (full[-1] if full else hits[0]) + 1
                return list(toks[begin : begin + k])
        return []
