"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the log-softmax of the logits at every
prompt position, read at the next prompt token, computed in the steps that prefill the prompt.

The hidden row of position q predicts the token at q + 1. A chunk computing positions
[start, start + n) of a prompt of P tokens therefore yields the logprobs of prompt tokens
start + 1 .. min(start + n, P - 1); the last prompt position predicts the first output token
(that one is sampled, not a prompt logprob)::

    positions   0    1    2    3    4          P = 5, chunks [0, 3) and [3, 5)
    chunk 1    [r0   r1   r2]                   r0 -> token 1, r1 -> token 2, r2 -> token 3
    chunk 2                  [r3   r4]          r3 -> token 4; r4 samples the first output

Entry i of a request's list is prompt token i + 1. A request asking for them skips the prefix
cache (``Scheduler``), so every position is computed here, across all chunks of chunked prefill.
Nothing here synchronises with the device: ``PromptLogprobTensors.output()`` reads the results
once the step's event passed.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.engine.host_batch import copy_to_host
from pdserve.engine.outputs import TokenLogprob

if TYPE_CHECKING:
    from pdserve.engine.host_batch import PinnedStaging
    from pdserve.engine.scheduler_output import SchedulerOutput

ROWS_PER_SLICE = 512  # bounds the fp32 [rows, vocab] logits materialised at once


@dataclass(frozen=True)
class PromptLogprobSpan:
    """One chunk's share: batch rows [row, row + len(target_ids)) predict ``target_ids``."""

    request_id: str
    start: int  # index of the first entry in the request's list (= its chunk's start position)
    row: int  # first token row of the step's batch
    target_ids: list[int]  # prompt tokens start + 1 .. start + len
    num_top: int


def prompt_logprob_spans(sched: SchedulerOutput) -> list[PromptLogprobSpan]:
    """The spans of a step's chunks whose requests ask for prompt logprobs (host-only work)."""
    spans: list[PromptLogprobSpan] = []
    row = 0
    for c in sched.chunks:
        req = c.request
        k = req.sampling_params.prompt_logprobs
        if k is not None:
            end = min(c.start_pos + c.num_tokens, req.num_prompt_tokens - 1)
            if end > c.start_pos:
                targets = req.prompt_token_ids[c.start_pos + 1 : end + 1]
                spans.append(PromptLogprobSpan(req.request_id, c.start_pos, row, targets, k))
        row += c.num_tokens
    return spans


@dataclass
class PromptLogprobTensors:
    spans: list[PromptLogprobSpan]
    chosen: torch.Tensor  # [R] float32, R = rows of all spans
    top_logprobs: torch.Tensor | None  # [R, K] float32, best first (K = largest num_top)
    top_token_ids: torch.Tensor | None  # [R, K] int64

    def copy_to_host(self, host_like: Callable[[torch.Tensor], torch.Tensor]) -> PromptLogprobTensors:
        """The same values in host tensors made by ``host_like`` (pinned on CUDA: queued behind
        the step's work, so reading them after the step's event waits for nothing later)."""

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            return copy_to_host(t, host_like)

        chosen = host(self.chosen)
        assert chosen is not None
        return PromptLogprobTensors(self.spans, chosen, host(self.top_logprobs), host(self.top_token_ids))

    def output(self) -> dict[str, tuple[int, list[TokenLogprob]]]:
        """request id -> (index of its first entry, entries); reads the tensors (call after the
        step's event)."""
        chosen = self.chosen.tolist()
        top_lp: list[list[float]] = self.top_logprobs.tolist() if self.top_logprobs is not None else []
        top_ids: list[list[int]] = self.top_token_ids.tolist() if self.top_token_ids is not None else []
        out: dict[str, tuple[int, list[TokenLogprob]]] = {}
        r = 0
        for s in self.spans:
            entries = []
            for tid in s.target_ids:
                top = (
                    tuple(zip(top_ids[r][: s.num_top], top_lp[r][: s.num_top], strict=True))
                    if top_ids
                    else ()
                )
                entries.append(TokenLogprob(tid, chosen[r], top))
                r += 1
            out[s.request_id] = (s.start, entries)
        return out


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    spans: list[PromptLogprobSpan],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    staging: PinnedStaging,
) -> PromptLogprobTensors:
    """Queue the logprob work for ``spans`` on ``hidden`` ([num_tokens, hidden], the last stage's
    output); ``compute_logits`` maps [n, hidden] to fp32 [n, vocab] logits."""
    rows = array("q")
    targets = array("q")
    for s in spans:
        rows.extend(range(s.row, s.row + len(s.target_ids)))
        targets.extend(s.target_ids)
    rows_d = staging.to_device(rows, torch.int64)  # [R]
    targets_d = staging.to_device(targets, torch.int64)  # [R]
    num_top = max(s.num_top for s in spans)
    chosen, top_lp, top_ids = [], [], []
    for i in range(0, len(rows), ROWS_PER_SLICE):
        lp = compute_logits(hidden[rows_d[i : i + ROWS_PER_SLICE]]).log_softmax(dim=-1)  # [r, V] fp32
        chosen.append(lp.gather(1, targets_d[i : i + ROWS_PER_SLICE, None]).squeeze(1))
        if num_top > 0:
            v, t = lp.topk(min(num_top, lp.shape[1]), dim=-1)
            top_lp.append(v)
            top_ids.append(t)
    return PromptLogprobTensors(
        spans,
        torch.cat(chosen),
        torch.cat(top_lp) if top_lp else None,
        torch.cat(top_ids) if top_ids else None,
    )
