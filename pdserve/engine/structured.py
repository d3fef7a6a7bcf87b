"""Structured outputs: grammar-constrained sampling with xgrammar; here, the per-step matcher
state. ``GrammarState`` is a request's matcher, ``advance`` catches matchers up with their
requests' new tokens (one batched accept in the steady state), ``SteadyRows`` the same for a
step whose rows are those of the step before, ``fill_bitmask`` writes the live rows' allowed
next tokens. The rest: a constraint's kinds and check, before anything runs (``grammar_spec``);
its compile and cache (``grammar_compile``); the fill thread (``bitmask_filler``); a step's
masks, owned by the model runner (``grammar_masks.GrammarMasker``).

The model runner masks each constrained row's logits in place with its matcher's token bitmask
before the argmax or the sampler (``kernels.apply_token_bitmask_``). Under asynchronous
scheduling the mask of step N+1 is filled while N+1's forward runs on the device, after step N's
tokens reached the host and advanced the matchers (``LLMEngine.execute_scheduled``). The
matcher is rebuilt from the request's output tokens so far whenever the runner first sees the
request: on the P/D path prefill samples the first token under the grammar, and decode replays
that token into a fresh matcher before its first step. Compiled grammars are cached per
tokenizer by the SHA-256 of (kind, spec), least recently used first out; a compile runs off the
engine thread under a size and a time limit (``pdserve.engine.grammar_compile``).
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from pdserve.config.engine import usable_cpus


@dataclass
class GrammarState:
    """A request's matcher and how many of its output tokens it has consumed."""

    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int = 0
    failed: bool = field(default=False)
    # Failed or terminated: never constrained again (a terminated matcher stays so without a
    # rollback, which nothing here does). Cached so a step asks xgrammar once per row at most.
    done: bool = field(default=False)

    @property
    def live(self) -> bool:
        """Whether the next token is constrained (not failed, grammar not terminated)."""
        if not self.done and (self.failed or self.matcher.is_terminated()):
            self.done = True
        return not self.done

    def catch_up(self, output_token_ids: list[int]) -> None:
        """Feed the tokens generated since the last call (all of them for a fresh matcher)."""
        for t in output_token_ids[self.num_accepted :]:
            if not self.live:
                break
            # A token the mask allowed is always accepted; a rejection means the history came
            # from outside the mask (e.g. replayed) and the row is left unconstrained from then on.
            if not self.matcher.accept_token(t):
                self.failed = True
        self.num_accepted = len(output_token_ids)


@functools.lru_cache(maxsize=1)
def _batch_matcher() -> Any:  # -> xgrammar.BatchGrammarMatcher
    import xgrammar as xgr

    # At a step's few dozen rows xgrammar's pool pays little or costs: 64 rows of the bench's
    # regex filled in 119 us on one thread and ~210 on two on a 2-core VM, in 329 / 230 / 408 us
    # on 1 / 4 / 8 threads of the H200's 16-core host (docs/benchmarks.md). A quarter of the
    # cores, at most 4.
    return xgr.BatchGrammarMatcher(max_threads=max(1, min(4, usable_cpus() // 4)))


def _batch_accept(matchers: list[Any], tokens: list[int]) -> list[bool] | None:
    """xgrammar's batched accept; None when every token was accepted (the steady state).

    The public ``BatchGrammarMatcher.batch_accept_token`` reads its result back one element at a
    time through tvm-ffi: ~57 of its ~89 us for 64 rows on the CI host. Asking the result
    whether it holds a rejection is one C-level scan (~1 us); the list is read only when it
    does. The public call is the fallback for an xgrammar without those internals."""
    core = _xgrammar_core()
    if core is None:
        accepted = _batch_matcher().batch_accept_token(matchers, tokens)
        return None if all(accepted) else accepted
    result = core.BatchGrammarMatcher.batch_accept_token([m._handle for m in matchers], tokens, False)
    if 0 not in result and False not in result:  # tvm-ffi compares by type: ints (this version) or bools
        return None
    return [bool(ok) for ok in result]


@functools.lru_cache(maxsize=1)
def _xgrammar_core() -> Any:
    """xgrammar's native module, if this xgrammar has the one the fast accept uses."""
    try:
        from xgrammar.base import _core
    except ImportError:
        return None
    return _core if hasattr(getattr(_core, "BatchGrammarMatcher", None), "batch_accept_token") else None


def advance(states: list[tuple[GrammarState, list[int]]], stop_ids: Collection[int]) -> list[int]:
    """Catch each matcher up with its request's output tokens; returns the indices (into
    ``states``) of those still live. The steady state (one new token per matcher since the
    last step) is one batched accept; anything else goes token by token.

    ``stop_ids``: the tokenizer's stop tokens (``GrammarCompiler.stop_ids``). A matcher made
    without ``terminate_without_stop_token`` (ours) ends only by accepting one of them, so the
    batched path asks xgrammar whether a matcher ended only after such a token."""
    one: list[Any] = []
    tokens: list[int] = []
    at: list[int] = []
    live: list[int] = []
    for k, (state, out) in enumerate(states):
        if state.done:
            continue
        if len(out) == state.num_accepted + 1:
            one.append(state.matcher)
            tokens.append(out[-1])
            at.append(k)
        else:
            state.catch_up(out)
            if state.live:
                live.append(k)
    if one:
        caught_up = len(live)
        accepted = _batch_accept(one, tokens)
        for j, (k, token) in enumerate(zip(at, tokens, strict=True)):
            state = states[k][0]
            state.num_accepted += 1
            if accepted is not None and not accepted[j]:
                state.failed = state.done = True
            elif token in stop_ids and state.matcher.is_terminated():
                state.done = True
            else:
                live.append(k)
        if caught_up and len(live) > caught_up:  # caught-up rows came first: back to input order
            live.sort()
    return live


class SteadyRows:
    """The grammar rows of the step before, kept for the next while a step's rows are the same
    requests in the same order (steady decode). Their live matchers are then caught up with one
    batched accept and a counter per row, without ``advance``'s per-row bookkeeping; ``advance``
    stays the general path (a row joined, left, ended or fell behind). Rows whose grammar is
    done (ended, failed) stay in the key and are skipped."""

    def __init__(self) -> None:
        self.ids: list[str] = []  # request ids, one per row; empty: nothing kept
        self._live: list[int] = []  # indices into ids of the rows still constrained
        self._states: list[GrammarState] = []  # theirs
        self._matchers: list[Any] = []
        self._next_lengths: list[int] = []  # their output lengths at the next step

    def keep(self, ids: list[str], states: list[GrammarState], live: list[int]) -> None:
        """Remember a step's rows after ``advance``: ``ids`` and ``states`` of every row,
        ``live`` the indices ``advance`` returned."""
        self.ids, self._live = ids, live
        self._states = [states[k] for k in live]
        self._matchers = [s.matcher for s in self._states]
        self._next_lengths = [s.num_accepted + 1 for s in self._states]

    def forget(self) -> None:
        self.ids, self._live, self._states, self._matchers, self._next_lengths = [], [], [], [], []

    @property
    def matchers(self) -> list[Any]:
        """The kept live rows' matchers (what ``take``'s tokens are accepted by)."""
        return self._matchers

    def take(
        self, ids: list[str], outputs: list[list[int]], stop_ids: frozenset[int]
    ) -> tuple[list[int], list[GrammarState], list[int]] | None:
        """``advance`` without the accept: when ``ids`` are the kept rows and each live one has
        exactly one new token, none a stop token, count those tokens as accepted and return the
        live rows (indices into ``ids``), their states and the tokens. The caller accepts them
        (``_batch_accept(self.matchers, tokens)``, on another thread if it likes) before the
        matchers are used again, and hands a rejection to ``rejected``. None: nothing was
        touched, use ``advance``."""
        if ids != self.ids or not ids:
            return None
        live = self._live
        if not live:
            return [], [], []
        if len(live) < len(outputs):
            outputs = [outputs[k] for k in live]
        lengths = [len(o) for o in outputs]
        if lengths != self._next_lengths:
            return None
        return self._took([o[-1] for o in outputs], stop_ids)

    def take_sampled(
        self, ids: list[str], sampled: dict[str, int], stop_ids: frozenset[int]
    ) -> tuple[list[int], list[GrammarState], list[int]] | None:
        """``take`` from the step's sampled tokens (request id -> token) before they reach the
        requests' histories: when ``ids`` are the kept rows and each live one was sampled in
        that step (its one new token), none a stop token. The engine's asynchronous loop calls
        it as soon as a step's samples are on the host, so the accept and the fill start before
        the step's outputs are processed. None: nothing was touched."""
        if ids != self.ids or not ids:
            return None
        live = self._live
        if not live:
            return [], [], []
        try:
            tokens = [sampled[ids[k]] for k in live]
        except KeyError:  # a row that did not sample then (it is not one new token each)
            return None
        return self._took(tokens, stop_ids)

    def _took(
        self, tokens: list[int], stop_ids: frozenset[int]
    ) -> tuple[list[int], list[GrammarState], list[int]] | None:
        """The kept live rows take one new token each (``tokens``), unless one is a stop token
        (a matcher may end there: ``advance`` asks it). Counters only; the accept is the caller's."""
        if not stop_ids.isdisjoint(tokens):
            return None
        for state in self._states:
            state.num_accepted += 1
        self._next_lengths = [n + 1 for n in self._next_lengths]
        return self._live, self._states, tokens

    def rejected(self, states: list[GrammarState], accepted: list[bool]) -> list[int]:
        """A batched accept of ``take``'s tokens rejected some: those rows' grammars failed (they
        run unconstrained from here on) and nothing is kept. Returns the positions in ``states``
        of the rows still live."""
        for state, ok in zip(states, accepted, strict=True):
            if not ok:
                state.failed = state.done = True
        self.forget()
        return [j for j, ok in enumerate(accepted) if ok]

    def advance(
        self, ids: list[str], outputs: list[list[int]], stop_ids: frozenset[int]
    ) -> tuple[list[int], list[GrammarState]] | None:
        """Advance the kept rows when ``ids`` are they and each live one has exactly one new
        token, none a stop token (``take``, then the batched accept here). Returns the live
        rows (indices into ``ids``) and their states (all that were live, unless a token was
        rejected). None: nothing was touched, use ``advance``."""
        taken = self.take(ids, outputs, stop_ids)
        if taken is None:
            return None
        live, states, tokens = taken
        if not live:
            return [], []
        accepted = _batch_accept(self._matchers, tokens)
        if accepted is None:
            return live, states
        kept = self.rejected(states, accepted)
        return [live[j] for j in kept], [states[j] for j in kept]


def fill_bitmask(states: list[GrammarState], bitmask: Any) -> None:
    """Row i of ``bitmask`` ([len(states), GrammarCompiler.mask_words] int32, host) := state i's
    allowed next tokens; one call."""
    _batch_matcher().batch_fill_next_token_bitmask([s.matcher for s in states], bitmask)
