"""A step's input embeddings (first pipeline stage only): a request's ``prompt_embeds`` and its
multimodal items' embeddings put into the rows the embedding table would fill. ModelRunner.launch
calls ``prompt_embeds`` then ``substitute_mm_embeds``; the admission checks of items are here too.

A request's ``mm_items`` name placeholder runs of its prompt; a chunk of the step covers
positions [start_pos, start_pos + num_tokens) at rows [row, row + num_tokens) of the batch:

    positions   start_pos ........................ start_pos + num_tokens
    item            |--- offset ......... end ---|
    overlap           lo = max(start, offset)  hi = min(end, item end)
    rows        row + lo - start_pos .. row + hi - start_pos  <-  embeds[lo - offset : hi - offset]

so chunked prefill and prefix hits that end inside an image take the right slice of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from pdserve.engine.request import MultiModalItem
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.errors import InvalidRequestError


def prompt_embeds(
    sched: SchedulerOutput,
    input_ids: torch.Tensor,  # [num_tokens]
    embed_tokens: nn.Module | None,
) -> torch.Tensor | None:
    """Input embeddings for a step that computes prompt positions given as embeddings.

    Rows of other tokens come from the embedding table; a request's prompt rows from its
    ``prompt_embeds`` ([num_prompt_tokens, hidden]). None when no chunk needs them.
    """
    if not any(
        c.request.prompt_embeds is not None and c.start_pos < c.request.num_prompt_tokens
        for c in sched.chunks
    ):
        return None
    assert embed_tokens is not None, "prompt embeddings reach the first pipeline stage only"
    out = embed_tokens(input_ids)  # [num_tokens, hidden]
    row = 0
    for c in sched.chunks:
        req = c.request
        if req.prompt_embeds is not None and c.start_pos < req.num_prompt_tokens:
            k = min(c.num_tokens, req.num_prompt_tokens - c.start_pos)
            out[row : row + k] = req.prompt_embeds[c.start_pos : c.start_pos + k].to(out.device, out.dtype)
        row += c.num_tokens
    return out


def needs_mm_embeds(sched: SchedulerOutput) -> bool:
    return any(
        it.offset < c.start_pos + c.num_tokens and c.start_pos < it.end
        for c in sched.chunks
        for it in c.request.mm_items
    )


def substitute_mm_embeds(
    sched: SchedulerOutput,
    input_ids: torch.Tensor,  # [num_tokens]
    embeds: torch.Tensor | None,  # [num_tokens, hidden] from prompt_embeds, or None
    embed_tokens: nn.Module | None,
) -> torch.Tensor | None:
    """``embeds`` (made from ``input_ids`` if None) with each item's rows put in place; None when
    no chunk of the step overlaps an item."""
    if not needs_mm_embeds(sched):
        return embeds
    if embeds is None:
        assert embed_tokens is not None, "image embeddings enter the first pipeline stage only"
        embeds = embed_tokens(input_ids)  # [num_tokens, hidden]
    row = 0
    for c in sched.chunks:
        start, end = c.start_pos, c.start_pos + c.num_tokens
        for it in c.request.mm_items:
            lo, hi = max(start, it.offset), min(end, it.end)
            if lo >= hi:
                continue
            if it.embeds is None:
                # Only decode nodes take items without tensors, and they never compute the run.
                raise InvalidRequestError(
                    f"request {c.request.request_id}: image at offset {it.offset} has no embeddings "
                    "but its positions must be computed here",
                    field="mm_items",
                )
            embeds[row + lo - start : row + hi - start] = it.embeds[lo - it.offset : hi - it.offset].to(
                embeds.device, embeds.dtype
            )
        row += c.num_tokens
    return embeds


def check_mm_items(
    items: Sequence[MultiModalItem], num_prompt_tokens: int, hidden: int
) -> tuple[MultiModalItem, ...]:
    """Items sorted, inside the prompt, not overlapping; each tensor [length, hidden], float and
    finite (kept on the CPU). An item without a tensor is allowed here: the node decides whether
    it may be missing (``allow_missing_mm_embeds``). Raises InvalidRequestError naming the item."""
    out: list[MultiModalItem] = []
    prev_end = 0
    for i, it in enumerate(items):
        if it.length < 1 or it.offset < prev_end or it.end > num_prompt_tokens:
            raise InvalidRequestError(
                f"mm_items[{i}]: placeholder run [{it.offset}, {it.end}) must be non-empty, in order, "
                f"not overlapping and inside the {num_prompt_tokens}-token prompt",
                field="mm_items",
            )
        prev_end = it.end
        t = it.embeds
        if t is not None:
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (it.length, hidden):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise InvalidRequestError(
                    f"mm_items[{i}]: embeddings must be [{it.length}, {hidden}], got {shape}",
                    field="mm_items",
                )
            if not t.is_floating_point():
                raise InvalidRequestError(
                    f"mm_items[{i}]: dtype {t.dtype} is not a float type", field="mm_items"
                )
            if not bool(torch.isfinite(t).all()):
                raise InvalidRequestError(f"mm_items[{i}]: embeddings hold NaN/inf", field="mm_items")
            it = dataclasses.replace(it, embeds=t.detach().cpu().contiguous())
        out.append(it)
    return tuple(out)
