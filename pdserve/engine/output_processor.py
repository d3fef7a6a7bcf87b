"""Output processing: the requests a finished step touched, turned into ``GenerationDelta``s.

``OutputProcessor`` holds the engine's per-request output state (``TrackedRequest``: the
detokenizer state, whether logprobs were asked for, the tokens already emitted, the prompt
logprobs) and does the host's work after a step: detokenization, stop strings, logprobs.
``LLMEngine`` owns one: it registers each admitted request (``add_request``), ``StepLauncher``
calls ``process`` once per completed step on the engine thread (the bench's phase timers and the
tests wrap it), and ``final_delta`` ends a request outside a step (abort, a failed KV pull or
grammar compile, ``fail_all``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.engine.detokenizer import DetokState, IncrementalDetokenizer
from pdserve.engine.outputs import GenerationDelta, TokenLogprob
from pdserve.engine.request import FINISH_REASON, Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.kvtransfer.params import RemoteDecodeParams


@dataclass
class TrackedRequest:
    req: Request
    detok: DetokState | None
    logprobs: bool
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    emitted_tokens: int = 0
    # SamplingParams.prompt_logprobs: entry i is prompt token i + 1, filled chunk by chunk and
    # sent with the request's first delta (then None: a recompute after preemption is ignored).
    prompt_logprobs: list[TokenLogprob | None] | None = None


def _continues_elsewhere(req: Request) -> bool:
    """A prefill leg whose decode continues on another node: keep an incomplete character
    back (decode's detokenizer completes it) instead of flushing it as U+FFFD."""
    p = req.kv_transfer_params
    return isinstance(p, RemoteDecodeParams) and not p.final_at_prefill and req.stop_reason is None


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, detok: IncrementalDetokenizer | None) -> None:
        self.scheduler = scheduler  # finishes a request that a stop string ended
        self.detok = detok  # None: no tokenizer loaded, deltas carry token ids only
        # Requests admitted and not yet handed their finishing delta, by request id.
        self.tracked: dict[str, TrackedRequest] = {}

    def add_request(self, req: Request, output_token_ids: list[int] | None) -> None:
        """Track an admitted request; ``output_token_ids`` (given at admission) count as emitted
        and are fed to its detokenizer."""
        params = req.sampling_params
        detok = None
        if self.detok is not None and params.detokenize:
            detok = self.detok.new_state(
                params.stop, params.include_stop_str_in_output, params.skip_special_tokens
            )
        self.tracked[req.request_id] = TrackedRequest(
            req,
            detok,
            params.logprobs is not None,
            emitted_tokens=len(output_token_ids or ()),
            prompt_logprobs=(
                [None] * (len(req.prompt_token_ids) - 1) if params.prompt_logprobs is not None else None
            ),
        )
        if output_token_ids and detok is not None:
            assert self.detok is not None
            self.detok.append(detok, list(output_token_ids))

    def add_first_tokens(self, request_id: str, first_tokens: Sequence[int]) -> None:
        """What prefill sampled, for a request pulling its KV that was admitted without them: they
        join its history as if given at admission (counted as emitted, fed to the detokenizer)."""
        tr = self.tracked.get(request_id)
        req0 = self.scheduler.waiting_for_kv.get(request_id)
        if req0 is not None and not req0.output_token_ids and not req0.is_finished:
            req0.output_token_ids.extend(first_tokens)
            if tr is not None:
                tr.emitted_tokens = len(req0.output_token_ids)
                if tr.detok is not None and self.detok is not None:
                    self.detok.append(tr.detok, list(first_tokens))

    def add_prompt_logprobs(self, chunks: dict[str, tuple[int, list[TokenLogprob]]]) -> None:
        """A step's prompt logprobs, ``request id -> (first prompt position, entries)``."""
        for rid, (start, entries) in chunks.items():
            tr = self.tracked.get(rid)
            if tr is not None and tr.prompt_logprobs is not None:
                tr.prompt_logprobs[start : start + len(entries)] = entries

    def process(
        self, touched: list[Request], logprobs: Mapping[str, TokenLogprob | list[TokenLogprob]]
    ) -> list[GenerationDelta]:
        """``logprobs``: one entry per request, or a list (a speculative step's several tokens)."""
        deltas: list[GenerationDelta] = []
        tracked = self.tracked
        for req in touched:
            rid = req.request_id
            tr = tracked.get(rid)
            if tr is None:
                continue
            out_ids = req.output_token_ids
            num_out = len(out_ids)
            new_ids = out_ids[tr.emitted_tokens :]
            tr.emitted_tokens = num_out
            lp = logprobs.get(rid) if logprobs else None
            lps = lp if isinstance(lp, list) else ([lp] if lp is not None else [])
            text = ""
            if tr.detok is not None and self.detok is not None:
                if len(new_ids) > 1 and tr.detok.stop:
                    # Several tokens at once (speculative decoding): one at a time, so the tokens
                    # after the one that completes a stop string are dropped, as without drafts.
                    text, new_ids = self._append_until_stop(tr.detok, req, new_ids)
                    num_out = tr.emitted_tokens = len(out_ids)
                else:
                    text = self.detok.append(tr.detok, new_ids)
                if tr.detok.stopped_by is not None and not req.is_finished:
                    req.stop_reason = tr.detok.stopped_by
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                if req.is_finished and not _continues_elsewhere(req):
                    text += self.detok.flush(tr.detok)
            delta = GenerationDelta(
                rid,
                new_ids,
                text,
                lps[: len(new_ids)] if tr.logprobs else None,
                num_prompt_tokens=len(req.prompt_token_ids),
                num_output_tokens=len(out_ids),  # a stop string may have ended it: count anew
                num_cached_tokens=req.num_cached_tokens,
            )
            if tr.prompt_logprobs is not None:
                assert all(e is not None for e in tr.prompt_logprobs), "a prompt position was not computed"
                delta.prompt_logprobs = tr.prompt_logprobs  # type: ignore[assignment]
                tr.prompt_logprobs = None
            if req.status.finished:
                delta.finish_reason = FINISH_REASON[req.status]
                delta.stop_reason = req.stop_reason
                del tracked[rid]
            deltas.append(delta)
        return deltas

    def _append_until_stop(self, st: DetokState, req: Request, new_ids: list[int]) -> tuple[str, list[int]]:
        assert self.detok is not None
        text = ""
        for i, t in enumerate(new_ids):
            text += self.detok.append(st, [t])
            if st.stopped_by is not None:
                del req.output_token_ids[len(req.output_token_ids) - (len(new_ids) - i - 1) :]
                return text, new_ids[: i + 1]
        return text, new_ids

    def final_delta(self, req: Request) -> GenerationDelta:
        self.tracked.pop(req.request_id, None)
        return GenerationDelta(
            request_id=req.request_id,
            token_ids=[],
            text="",
            finish_reason=FINISH_REASON.get(req.status, "abort"),
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
        )
