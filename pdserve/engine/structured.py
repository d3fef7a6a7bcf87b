"""Structured outputs: grammar-constrained sampling with xgrammar.

A request's constraint is a ``(kind, spec)`` pair on its SamplingParams (kinds below). The
grammar is checked where the params are built (the router, or a node reading the proto), so a
bad schema or regex is a 400 / INVALID_ARGUMENT naming the problem before anything runs.

The model runner masks each constrained row's logits in place with its matcher's token bitmask
before the argmax or the sampler (``kernels.apply_token_bitmask_``). Under asynchronous
scheduling the mask of step N+1 is filled while N+1's forward runs on the device, after step N's
tokens reached the host and advanced the matchers (``LLMEngine.execute_scheduled``). The
matcher is rebuilt from the request's output tokens so far whenever the runner first sees the
request: on the P/D path prefill samples the first token under the grammar, and decode replays
that token into a fresh matcher before its first step. Compiled grammars are cached per
(tokenizer, kind, spec).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from pdserve.errors import InvalidRequestError

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


def _grammar(kind: str, spec: str) -> Any:  # -> xgrammar.Grammar
    import xgrammar as xgr  # lazy: the scheduler's import path stays free of torch

    if kind == "json_object":
        return xgr.Grammar.builtin_json_grammar()
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec)
    if kind == "choice":
        choices = json.loads(spec)
        # EBNF string literals take JSON's escapes.
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in choices))
    raise AssertionError(kind)


@functools.lru_cache(maxsize=256)
def check(kind: str, spec: str) -> None:
    """Raise InvalidRequestError naming the problem when the constraint does not parse."""
    if kind not in KINDS:
        raise InvalidRequestError(f"structured_outputs: unknown kind {kind!r}; one of {KINDS}", field=kind)
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"choice: not a JSON list: {e}", field="choice") from e
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
            raise InvalidRequestError("choice: must be a non-empty list of non-empty strings", field="choice")
    try:
        _grammar(kind, spec)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise InvalidRequestError(f"invalid {kind}: {msg}", field=kind) from e


class GrammarCompiler:
    """One per model runner: compiles constraints for a tokenizer, cached by (kind, spec)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int] | None = None) -> None:
        import xgrammar as xgr

        # The grammar covers the tokenizer's ids only, not the model's padded vocabulary: ids past
        # the tokenizer are no token at all, the mask kernel bans every column past the bitmask,
        # and xgrammar's accept_token costs grow with the padding (36 µs instead of 1.7 per token
        # for a 616-token tokenizer in a 128,256-row LM head: the grammar bench's Llama-1B shape).
        mask_vocab = min(vocab_size, max(len(tokenizer), max(stop_token_ids or [0]) + 1))
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=mask_vocab, stop_token_ids=stop_token_ids
        )
        self.vocab_size = vocab_size
        self.mask_vocab = mask_vocab  # ids the bitmask covers; every id from here on is banned
        self.mask_words = (mask_vocab + 31) // 32  # int32 words per bitmask row
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self._cache: dict[tuple[str, str], Any] = {}

    def compile(self, kind: str, spec: str) -> Any:  # -> xgrammar.CompiledGrammar
        key = (kind, spec)
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._compiler.compile_grammar(_grammar(kind, spec))
            self._cache[key] = compiled
        return compiled

    def matcher(self, kind: str, spec: str) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(self.compile(kind, spec)))


@dataclass
class GrammarState:
    """A request's matcher and how many of its output tokens it has consumed."""

    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int = 0
    failed: bool = field(default=False)

    @property
    def live(self) -> bool:
        """Whether the next token is constrained (not failed, grammar not terminated)."""
        return not self.failed and not self.matcher.is_terminated()

    def catch_up(self, output_token_ids: list[int]) -> None:
        """Feed the tokens generated since the last call (all of them for a fresh matcher)."""
        for t in output_token_ids[self.num_accepted :]:
            if self.failed or self.matcher.is_terminated():
                break
            # A token the mask allowed is always accepted; a rejection means the history came
            # from outside the mask (e.g. replayed) and the row is left unconstrained from then on.
            if not self.matcher.accept_token(t):
                self.failed = True
        self.num_accepted = len(output_token_ids)


@functools.lru_cache(maxsize=1)
def _batch_matcher() -> Any:  # -> xgrammar.BatchGrammarMatcher
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher(max_threads="auto")


def advance(states: list[tuple[GrammarState, list[int]]]) -> None:
    """Catch each matcher up with its request's output tokens. The steady state (one new token
    per matcher since the last step) is one batched accept; anything else goes token by token."""
    one: list[GrammarState] = []
    tokens: list[int] = []
    for state, out in states:
        if len(out) == state.num_accepted + 1 and state.live:
            one.append(state)
            tokens.append(out[-1])
        else:
            state.catch_up(out)
    if not one:
        return
    accepted = _batch_matcher().batch_accept_token([s.matcher for s in one], tokens)
    for state, ok in zip(one, accepted, strict=True):
        state.num_accepted += 1
        state.failed = state.failed or not ok


def fill_bitmask(states: list[GrammarState], bitmask: Any) -> None:
    """Row i of ``bitmask`` ([len(states), GrammarCompiler.mask_words] int32, host) := state i's
    allowed next tokens; one call, on xgrammar's thread pool."""
    _batch_matcher().batch_fill_next_token_bitmask([s.matcher for s in states], bitmask)
