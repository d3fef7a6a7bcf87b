"""What the P/D handshake compares of the speculative config (docs/design.md §8). No torch.

Each KV peer announces ``method|drafter identity|k`` ("" without speculation). Verification is
lossless whatever the drafts are, so no pair changes tokens; a decode node whose drafter reads
state the prefill node computes would, without it, draft from stale KV and its acceptance would
collapse without a word, so such a pair is refused. The rule per method:

    ngram        reads the token ids the decode node holds: any pair is served
    draft_model  the decode node rebuilds the draft model's KV from the prompt tokens itself
                 (spec_decode/draft_model.py): any pair is served; its identity names the draft
                 checkpoint by content (``draft_model[sha256 prefix]``)
    mtp          reads MTP KV the prefill node computes and the transfer moves as one more layer
                 (spec_decode/mtp_drafter.py): both sides must announce the same config
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config.speculative import SpeculativeConfig

# Methods whose drafter needs state computed on the prefill node.
NEEDS_PREFILL_STATE = frozenset({"mtp", "eagle", "eagle3", "medusa"})


@dataclass(frozen=True)
class SpecIdentity:
    method: str
    drafter: str
    num_speculative_tokens: int

    def to_wire(self) -> str:
        return f"{self.method}|{self.drafter}|{self.num_speculative_tokens}"

    @classmethod
    def from_wire(cls, s: str) -> SpecIdentity | None:
        if not s:
            return None
        method, drafter, k = s.split("|")
        return cls(method, drafter, int(k))

    @classmethod
    def of(cls, config: SpeculativeConfig | None) -> SpecIdentity | None:
        if config is None:
            return None
        return cls(config.method, config.drafter_identity, config.num_speculative_tokens)


def spec_wire(config: SpeculativeConfig | None) -> str:
    """The handshake's ``speculative`` field of a node with ``config``."""
    ident = SpecIdentity.of(config)
    return ident.to_wire() if ident is not None else ""


def speculative_mismatch(local: str, remote: str) -> str | None:
    """Why the two announced configs cannot serve a request together (None: they can)."""
    a, b = SpecIdentity.from_wire(local), SpecIdentity.from_wire(remote)
    needs = any(x is not None and x.method in NEEDS_PREFILL_STATE for x in (a, b))
    if not needs or a == b:
        return None
    return (
        "the drafter reads state the prefill node computes (mtp: its KV for the prompt; method, "
        "drafter identity and num_speculative_tokens must be equal on both sides; n-gram and "
        "draft_model need nothing from prefill)"
    )
