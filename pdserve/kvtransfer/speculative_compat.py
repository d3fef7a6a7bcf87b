"""What the P/D handshake compares of the speculative config (docs/design.md §8). No torch.

Each KV peer announces ``method|drafter identity|k`` ("" without speculation). A drafter that
reads state prefill must fill (a draft model's or an MTP module's KV for the prompt, the last
hidden state) makes a mismatch change tokens, so then both sides must announce the same
identity. An n-gram drafter reads only the token ids the decode node already holds: it needs
nothing from prefill, and a pair where one side drafts by n-gram and the other does not (or
drafts by n-gram with other settings) is served, its tokens those of the decode node's config.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config.speculative import SpeculativeConfig

# Methods whose drafter needs state computed on the prefill node.
NEEDS_PREFILL_STATE = frozenset({"draft_model", "mtp", "eagle", "eagle3", "medusa"})


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
        "the drafter reads state the prefill node computes (method, drafter identity and "
        "num_speculative_tokens must be equal on both sides; n-gram needs nothing from prefill)"
    )
