"""The ``speculative:`` entry of a node in the cluster file (validated as SpeculativeConfig)."""

from __future__ import annotations

from pydantic import model_validator

from pdserve.config.frozen import _Frozen
from pdserve.config.speculative import SpeculativeConfig, check_ngram_only


class SpeculativeSettings(_Frozen):
    method: str = "ngram"  # ngram | draft_model | mtp (anything else is refused at load)
    num_speculative_tokens: int = 3  # draft tokens verified per step and request
    prompt_lookup_min: int = 1  # n-gram: shortest suffix looked up
    prompt_lookup_max: int = 4  # n-gram: longest suffix looked up (tried first)
    model: str | None = None  # draft_model: the draft checkpoint (same tokenizer as the target)
    disable_by_batch_size: int | None = None  # from this many running requests on, no drafts

    @model_validator(mode="after")
    def _check(self) -> SpeculativeSettings:
        check_ngram_only(self.method, set(self.model_fields_set))
        self.engine_config()  # raises ConfigError naming the value and what is supported
        return self

    def engine_config(self) -> SpeculativeConfig:
        return SpeculativeConfig(
            self.method,
            self.num_speculative_tokens,
            self.prompt_lookup_min,
            self.prompt_lookup_max,
            self.disable_by_batch_size,
            self.model,
        )
