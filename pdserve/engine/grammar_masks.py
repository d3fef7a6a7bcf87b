"""A step's grammar masks (structured outputs): matchers advanced with the tokens of the step
before, the bitmask of the live rows filled, then applied where the step samples.

The model runner owns one ``GrammarMasker``. Per step with constrained rows:

    start(...)   the matchers take the previous step's tokens; the live rows' bitmask is filled
                 into a host buffer (on the ``BitmaskFiller`` thread when asked to overlap, and
                 in steady decode the accept goes there too: both let go of the GIL)
    apply(...)   waits for the fill and sets the banned logits to -inf in place (the sampler)
    argmax(...)  waits for the fill and returns each row's best allowed token (greedy steps; on
                 CUDA one fused launch with the argmax, the logits not written)

On CUDA the bitmask (and the row map of a partly constrained batch) sit in two pinned host
buffers used in turn, allocated once for ``max_num_seqs`` rows; the kernels read them in place
where ``kernels.host_operands_readable`` says the device can (unified addressing), else they
are copied over as before. A buffer is written again two grammar steps later, after the engine
waited for a later step, so no kernel still reads it. Every host call here is on the engine
thread's critical path at batch 64 on a GPU (docs/benchmarks.md): no per-step allocation, a
cached view per row count.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pdserve import kernels
from pdserve.config.engine import EngineConfig
from pdserve.engine.bitmask_filler import FILLER_SWITCH_INTERVAL_S, BitmaskFill, BitmaskFiller
from pdserve.engine.grammar_compile import GrammarCompiler
from pdserve.engine.host_batch import PinnedStaging
from pdserve.engine.request import Request
from pdserve.engine.structured import GrammarState, SteadyRows, _batch_accept, advance, fill_bitmask


@dataclass
class GrammarMasks:
    """A step's grammar masks on their way: the live rows' bitmask, being filled in host memory
    (on the masker's filler thread when ``fill`` is set, else already filled)."""

    rows: list[int]  # logits rows of the live grammars, increasing; empty: nothing to mask
    host: torch.Tensor | None  # [len(rows), mask_words] int32 host view
    fill: BitmaskFill | None
    states: list[GrammarState] = field(default_factory=list)  # the live rows' matchers
    turn: int = 0  # which host buffer ``host`` is in


class GrammarMasker:
    def __init__(
        self, config: EngineConfig, device: torch.device, staging: PinnedStaging, use_filler: bool
    ) -> None:
        self.config = config
        self.device = device
        self.staging = staging
        self.states: dict[str, GrammarState] = {}  # structured-output matchers by request id
        self.steady = SteadyRows()  # the last step's grammar rows (steady decode)
        self.compiler: GrammarCompiler | None = None
        # Bitmask fills on a thread of their own where cores are to spare (made by the first fill
        # that can overlap: asynchronous scheduling, where they overlap the previous step's
        # processing; never on TP workers or pipeline stages, which fill inline).
        self.use_filler = use_filler
        self.filler: BitmaskFiller | None = None
        # The interpreter's switch interval while a fill is under way (BitmaskFiller's docstring);
        # bench/structured_cpu.py --switch-interval-us sets it before the first fill.
        self.filler_switch_interval_s = FILLER_SWITCH_INTERVAL_S
        self._bufs: list[torch.Tensor] = []  # two host buffers: [cap * words] bitmask, [cap] row map
        self._cap = 0
        self._turn = 0
        self._views: dict[tuple[int, int], torch.Tensor] = {}  # (turn, rows) -> [rows, words] view
        self._maps: dict[tuple[int, int], tuple[torch.Tensor, np.ndarray]] = {}  # (turn, n) -> row map
        self._in_place: bool | None = None  # kernels read the pinned buffers in place (CUDA)

    # -- per request ------------------------------------------------------------------------------
    def state(self, request: Request, vocab_size: int) -> GrammarState:
        """The request's matcher, built on first sight (``advance`` then feeds it the output
        tokens so far; on decode after P/D: the first token prefill sampled under the grammar)."""
        structured = request.sampling_params.structured
        assert structured is not None
        state = self.states.get(request.request_id)
        if state is None:
            if self.compiler is None:
                from pdserve.models.loader import load_tokenizer

                self.compiler = GrammarCompiler(
                    load_tokenizer(self.config.model), vocab_size, sorted(request.eos_token_ids) or None
                )
            state = self.compiler.matcher(*structured)
            self.states[request.request_id] = state
        return state

    def drop(self, request_id: str) -> None:
        if self.states.pop(request_id, None) is not None:
            self.steady.forget()  # a row left: the next step's rows differ anyway

    def close(self) -> None:
        """Stop the bitmask filler thread, if one was started (idempotent)."""
        if self.filler is not None:
            self.filler.close()
            self.filler = None

    # -- host buffers -----------------------------------------------------------------------------
    def _host(self, rows: int) -> tuple[torch.Tensor, int]:
        """A [rows, mask_words] int32 host view for this step's bitmask, and its buffer's turn."""
        assert self.compiler is not None
        words = self.compiler.mask_words
        if not self._bufs:
            self._cap = max(self.config.scheduler.max_num_seqs, 1)
            pin = self.staging.pinned
            self._bufs = [
                torch.empty(self._cap * (words + 1), dtype=torch.int32, pin_memory=pin) for _ in range(2)
            ]
        if rows > self._cap:  # more sampled rows than max_num_seqs: a one-off buffer of the step
            return self.staging.host_empty((rows, words), torch.int32), -1
        self._turn = turn = 1 - self._turn
        return self._view(turn, rows), turn

    def _view(self, turn: int, rows: int) -> torch.Tensor:
        view = self._views.get((turn, rows))
        if view is None:
            assert self.compiler is not None
            words = self.compiler.mask_words
            view = self._views[turn, rows] = self._bufs[turn][: rows * words].view(rows, words)
        return view

    def _row_map(self, turn: int, n: int) -> tuple[torch.Tensor, np.ndarray]:
        """The int32 [n] row-map view of buffer ``turn`` (after its bitmask region) and its
        numpy twin, to write on the host."""
        got = self._maps.get((turn, n))
        if got is None:
            assert self.compiler is not None
            start = self._cap * self.compiler.mask_words
            t = self._bufs[turn][start : start + n]
            got = self._maps[turn, n] = (t, t.numpy())
        return got

    def _on_device(self, host: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``host`` as the kernel on ``logits`` takes it: in place where the device reads pinned
        memory (Triton kernels), else a non-blocking copy from the pinned buffer queued behind
        the forward on the compute stream (a side stream's host calls cost more than the copy)."""
        if not self.staging.pinned:
            return host
        if self._in_place is None:
            self._in_place = kernels.host_operands_readable(self.device)
        if self._in_place and kernels.wants_triton(logits):
            return host
        return host.to(self.device, non_blocking=True)

    # -- a step -----------------------------------------------------------------------------------
    def start(self, chunks: list[Any], grammar_rows: list[int], vocab: int, overlap: bool) -> GrammarMasks:
        """Advance the matchers of the ``grammar_rows`` of a step's sampling ``chunks`` with
        their requests' output tokens and start filling the live ones' bitmask (one batched
        call; on the filler thread when there is one and ``overlap``: other host work comes
        before the wait). Rows of requests that finished while the step was in flight are
        skipped (their tokens are dropped)."""
        reqs = [chunks[i].request for i in grammar_rows]
        ids = [r.request_id for r in reqs]
        steady = self.steady
        # Only this step's own token may be in flight: every earlier one is in the history, so
        # the mask is never built from a stale matcher.
        assert all(r.num_output_placeholders == 1 or r.is_finished for r in reqs), ids
        taken = None
        if not any(r.is_finished for r in reqs) and self.compiler is not None:
            taken = steady.take(ids, [r.output_token_ids for r in reqs], self.compiler.stop_ids)
        accept: tuple[list[Any], list[int]] | None = None
        if taken is not None:  # steady decode: the accept goes with the fill
            live, states, tokens = taken
            if not live:
                return GrammarMasks([], None, None)
            rows = grammar_rows if len(live) == len(reqs) else [grammar_rows[k] for k in live]
            accept = (steady.matchers, tokens)
        else:  # the general path; rows of requests that finished meanwhile are skipped
            pairs: list[tuple[GrammarState, list[int]]] = []
            all_rows = []
            for i, req in zip(grammar_rows, reqs, strict=True):
                if req.is_finished:
                    continue
                pairs.append((self.state(req, vocab), req.output_token_ids))
                all_rows.append(i)
            if not pairs:
                steady.forget()
                return GrammarMasks([], None, None)
            assert self.compiler is not None  # made by the first state() call above
            live = advance(pairs, self.compiler.stop_ids)
            if len(pairs) == len(ids):
                steady.keep(ids, [p[0] for p in pairs], live)
            else:
                steady.forget()
            states = [pairs[k][0] for k in live]
            rows = [all_rows[k] for k in live]
            if not live:
                return GrammarMasks([], None, None)
        if overlap and self.use_filler:
            return self._to_filler(rows, states, accept)
        host, turn = self._host(len(states))
        masks = GrammarMasks(rows, host, None, states, turn)
        rejected = _batch_accept(*accept) if accept is not None else None
        if rejected is not None:
            self._redo(masks, rejected)
        else:
            fill_bitmask(states, host)
        return masks

    def start_sampled(
        self, chunks: list[Any], grammar_rows: list[int], sampled: dict[str, int]
    ) -> GrammarMasks | None:
        """``start`` for steady decode on the filler thread, from the previous step's ``sampled``
        tokens (request id -> token) before they reach the histories (``SteadyRows.take_sampled``):
        the accept and the fill get the time the engine spends on that step's outputs. None:
        not steady or no filler; ``start`` runs once the tokens are in the histories."""
        if not self.use_filler or self.compiler is None or not self.steady.ids:
            return None
        ids = [chunks[i].request.request_id for i in grammar_rows]
        taken = self.steady.take_sampled(ids, sampled, self.compiler.stop_ids)
        if taken is None:
            return None
        live, states, tokens = taken
        if not live:
            return GrammarMasks([], None, None)
        rows = grammar_rows if len(live) == len(grammar_rows) else [grammar_rows[k] for k in live]
        return self._to_filler(rows, states, (self.steady.matchers, tokens))

    def _to_filler(
        self, rows: list[int], states: list[GrammarState], accept: tuple[list[Any], list[int]] | None
    ) -> GrammarMasks:
        """The fill of ``states``' bitmask (after ``accept``'s batched accept, if given) handed to
        the filler thread, started on first use."""
        host, turn = self._host(len(states))
        if self.filler is None:
            self.filler = BitmaskFiller(self.filler_switch_interval_s)
        return GrammarMasks(rows, host, self.filler.submit(states, host, accept), states, turn)

    def _redo(self, masks: GrammarMasks, accepted: list[bool]) -> None:
        """The steady accept rejected a token (it came from outside the mask, e.g. replayed):
        those rows run unconstrained from here on; the rest's bitmask is filled here."""
        kept = self.steady.rejected(masks.states, accepted)
        masks.rows = [masks.rows[j] for j in kept]
        masks.states = [masks.states[j] for j in kept]
        if not kept:
            masks.host = None
            return
        if masks.turn >= 0:  # the same buffer, fewer rows (the fill that rejected has ended)
            masks.host = self._view(masks.turn, len(kept))
        else:
            assert masks.host is not None
            masks.host = masks.host[: len(kept)]
        fill_bitmask(masks.states, masks.host)

    def wait(self, masks: GrammarMasks) -> None:
        """Until ``masks``' fill (and accept) ended; a rejection is redone here."""
        fill = masks.fill
        if fill is None:
            return
        fill.wait(self.config.step_timeout_s)
        masks.fill = None
        if fill.rejected is not None:
            self._redo(masks, fill.rejected)

    def apply(self, logits: torch.Tensor, masks: GrammarMasks) -> None:
        """Wait for ``masks`` and set the banned tokens of their rows of ``logits`` to -inf."""
        self.wait(masks)
        rows = masks.rows
        if not rows:
            return
        assert masks.host is not None
        bitmask = self._on_device(masks.host, logits)
        idx = None
        if rows[-1] != len(rows) - 1:  # not rows 0..k-1 (increasing, distinct)
            if (
                self.staging.pinned and masks.turn >= 0 and bitmask is masks.host
            ):  # read in place: the indices too
                idx, arr = self._row_map(masks.turn, len(rows))
                arr[:] = rows
            else:
                idx = self.staging.to_device(array("q", rows), torch.int64)
        kernels.apply_token_bitmask_(logits, bitmask, idx)

    def argmax(self, logits: torch.Tensor, masks: GrammarMasks) -> torch.Tensor:
        """Wait for ``masks``; each row's best allowed token (int64 [rows]). On CUDA the mask and
        the argmax are one fused kernel pass that leaves ``logits`` as they are; elsewhere the
        mask is applied in place, then the argmax."""
        if not self.staging.pinned or masks.turn < 0:
            self.apply(logits, masks)
            return kernels.argmax_rows(logits)
        self.wait(masks)
        rows = masks.rows
        if not rows:
            return kernels.argmax_rows(logits)
        assert masks.host is not None
        n = logits.shape[0]
        row_map = None
        if len(rows) != n:
            row_map, arr = self._row_map(masks.turn, n)
            arr.fill(-1)
            arr[rows] = np.arange(len(rows), dtype=np.int32)
            row_map = self._on_device(row_map, logits)
        return kernels.masked_argmax_rows(logits, self._on_device(masks.host, logits), row_map)
