"""The ``speculative:`` setting of a node (cluster file) and of ``LLM(...)``. No torch.

speculative:
  method: ngram                 # the one method built; anything else is refused at start
  num_speculative_tokens: 3     # k: draft tokens verified per step and request
  prompt_lookup_min: 1          # shortest suffix n-gram looked up in the request's tokens
  prompt_lookup_max: 4          # longest (tried first)
  disable_by_batch_size: null   # from this many requests running on, no drafts (null: never)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.errors import ConfigError

SUPPORTED_METHODS = ("ngram",)
# Methods other engines know; named in the refusal so a user sees it is a known-but-unbuilt one.
KNOWN_UNBUILT_METHODS = ("draft_model", "mtp", "eagle", "eagle3", "medusa")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # Under load a verification step costs more than the tokens it saves (every row computes
    # 1 + m tokens): from this many running requests on, steps run without drafts. None: never.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SUPPORTED_METHODS:
            known = " (known, not built here)" if self.method in KNOWN_UNBUILT_METHODS else ""
            raise ConfigError(
                f"speculative.method {self.method!r}{known} is not supported; supported: "
                f"{', '.join(SUPPORTED_METHODS)}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(
                f"speculative.num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                "speculative: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ConfigError(
                f"speculative.disable_by_batch_size must be >= 1 or unset, got {self.disable_by_batch_size}"
            )

    @property
    def drafter_identity(self) -> str:
        """What names the drafter (the P/D handshake compares it): n-gram has no weights."""
        return f"ngram[{self.prompt_lookup_min},{self.prompt_lookup_max}]"

    @classmethod
    def from_value(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """A mapping (``LLM(speculative={...})``, a cluster file) or a config; None stays None.
        An unknown key is refused with the keys that exist."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"speculative must be a mapping of settings, got {type(value).__name__}")
        fields = (
            "method",
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "disable_by_batch_size",
        )
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ConfigError(f"speculative: unknown setting(s) {unknown}; known: {', '.join(fields)}")
        return cls(**dict(value))
