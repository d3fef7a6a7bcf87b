"""Per-request sampling parameters, validated on construction.

Invalid values raise :class:`InvalidRequestError` naming the field and the allowed range, before
anything is allocated for the request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdserve.errors import InvalidRequestError

MAX_LOGPROBS = 20
_SEED_MOD = 2**63


def _check(cond: bool, fld: str, msg: str) -> None:
    if not cond:
        raise InvalidRequestError(f"{fld}: {msg}", field=fld)


GREEDY_BELOW = 1e-5  # temperature; see SamplingParams.greedy


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # per-request generator: same seed, same tokens, whatever the batch
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs of each sampled position (None: off)
    # top-N logprobs of each prompt token from the second on (None: off). Computed where the
    # prompt is prefilled; such a request skips the prefix cache (a hit has no logits).
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Structured outputs: (kind, spec), kind one of grammar_spec.KINDS (json_schema: the schema as
    # JSON text; choice: a JSON list of strings). None: unconstrained.
    structured: tuple[str, str] | None = None
    # False: deltas carry token ids and no text (as vLLM's ``detokenize``). The router sets it
    # when it detokenizes itself, which takes that work off the node's engine thread; stop
    # strings need the text where the tokens are made, so they are refused with it.
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        _check(isinstance(self.n, int) and 1 <= self.n <= 128, "n", f"must be in [1, 128], got {self.n!r}")
        _check(
            0.0 <= self.temperature <= 100.0,
            "temperature",
            f"must be in [0, 100], got {self.temperature!r}",
        )
        _check(self.top_k >= 0, "top_k", f"must be -1, 0 (disabled) or > 0, got {self.top_k!r}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            f"must be >= 1, got {self.max_tokens!r}",
        )
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens!r}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        for lp_field in ("logprobs", "prompt_logprobs"):
            v = getattr(self, lp_field)
            _check(
                v is None or 0 <= v <= MAX_LOGPROBS,
                lp_field,
                f"must be in [0, {MAX_LOGPROBS}], got {v!r}",
            )
        _check(
            0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            f"must be in (0, 2], got {self.repetition_penalty!r}",
        )
        for pen in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, pen)
            _check(-2.0 <= v <= 2.0, pen, f"must be in [-2, 2], got {v!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(len(self.stop) <= 16, "stop", f"at most 16 stop strings, got {len(self.stop)}")
        _check(
            self.detokenize or not self.stop,
            "stop",
            "stop strings need detokenize=True (the text is matched where the tokens are made)",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative token ids",
        )
        if self.structured is not None:
            from pdserve.engine import grammar_spec  # lazy: xgrammar only for constrained requests

            kind, spec = self.structured
            grammar_spec.check(kind, spec)
        if self.seed is not None:
            _check(
                isinstance(self.seed, int) and 0 <= self.seed < _SEED_MOD,
                "seed",
                f"must be in [0, 2**63), got {self.seed!r}",
            )

    @property
    def greedy(self) -> bool:
        """Temperatures below ``GREEDY_BELOW`` decode greedily (as vLLM does): dividing by one
        rounds to infinity or to a float32 zero, which no sampling path computes the same way."""
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the generated token ids (not only their count)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def for_sample(self, index: int) -> SamplingParams:
        """Sample ``index`` of an ``n``-sample request as its own n=1 request (the engine runs
        n=1). A seeded request's sample i runs with seed + i (mod 2**63): samples differ, and the
        same request replays the same samples; unseeded or greedy samples keep their params."""
        assert 0 <= index < self.n, f"sample {index} of n={self.n}"
        seed = None if self.seed is None else (self.seed + index) % _SEED_MOD
        return dataclasses.replace(self, n=1, seed=seed)
