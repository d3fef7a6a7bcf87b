"""Counters of speculative decoding, with vLLM's meaning (the node's pdserve:spec_decode_* metrics).

    num_drafts          verification steps of a request that carried >= 1 draft token
    num_draft_tokens    draft tokens verified
    num_accepted_tokens draft tokens accepted (the bonus / correction token is not counted)
    accepted_per_pos[i] drafts accepted at position i of a draft (i = 0 .. k-1)

Mean accepted length (tokens emitted per verification step) = 1 + accepted / drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_draft_tokens, (num_accepted, num_draft_tokens)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification step of a drafted request (1.0 when nothing was drafted)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
