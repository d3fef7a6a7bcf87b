"""When a request ends by its tokens, and when the next step may be scheduled ahead. No torch.

``check_stop`` is the scheduler's test of a sampled token (EOS, ``stop_token_ids`` after
``min_tokens``, ``max_tokens``, ``max_model_len``; stop strings are the detokenizer's), called by
``Scheduler.update_from_output`` and ``SpecScheduling.apply``.

``Scheduler.schedule()`` advances each scheduled request's ``num_computed_tokens`` at once, and
counts a token it will sample as a placeholder, so the next step can be scheduled while this one
still runs on the GPU (asynchronous scheduling, ``LLMEngine``):

    step N   scheduled, launched            request r: num_computed = p, placeholders = 1
    step N+1 scheduled before N's tokens     r's chunk: position p, input token = N's sample,
             are known on the host           fed on the device (the runner)
    N's output processed                     r: token appended, placeholders = 0; a stop found
                                             now wastes r's row in N+1 (its token is dropped)

A request whose in-flight token is its last by length (max_tokens, max_model_len:
``finishes_by_length``) is not scheduled ahead. ``can_schedule_ahead()`` says when looking ahead
is safe: no request with a token in flight needs its token history for sampling (penalties,
min_tokens), and the free blocks cover every running request's next chunk, so no preemption can
be needed.
"""

from __future__ import annotations

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus


def check_stop(req: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """The status ``req`` finishes with now that ``token`` was appended; None: it goes on."""
    sp = req.sampling_params
    num_out = len(req.output_token_ids)
    if num_out >= sp.min_tokens:
        if not sp.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if sp.stop_token_ids and token in sp.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if sp.max_tokens is not None and num_out >= sp.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if len(req.prompt_token_ids) + num_out >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def finishes_by_length(req: Request, max_model_len: int) -> bool:
    """Whether the tokens sampled so far (in flight included) already end the request."""
    max_tokens = req.sampling_params.max_tokens
    num_out = len(req.output_token_ids) + req.num_output_placeholders
    return (max_tokens is not None and num_out >= max_tokens) or (
        len(req.prompt_token_ids) + num_out >= max_model_len
    )


def can_schedule_ahead(running: list[Request], kv: KVCacheManager) -> bool:
    """Whether the next step may be scheduled while the last one's tokens are still in flight.

    No: a request with a token in flight samples from its token history (penalties, or
    min_tokens not yet reached: the host's history lacks the in-flight token), or the free
    blocks might not cover every running request's next chunk (a preemption would have to
    wait for the in-flight step). The engine then completes the in-flight step first.
    A grammar does not need this: its mask is filled after the in-flight step's tokens
    reached the host, while the next step's forward already runs (``LLMEngine``).
    """
    bound = 0  # an upper bound of the blocks needed: 1 per decode, ceil(gap / bs) + 1 else
    bs = kv.block_size
    gaps: list[tuple[Request, int]] = []
    for req in running:
        ph = req.num_output_placeholders
        if ph:
            sp = req.sampling_params
            if sp.has_penalties or len(req.output_token_ids) < sp.min_tokens:
                return False
        gap = len(req.prompt_token_ids) + len(req.output_token_ids) + ph - req.num_computed_tokens
        if gap > 0:
            bound += 1 if gap == 1 else 1 + -(-gap // bs)
            gaps.append((req, gap))
    free = kv.pool.num_free_blocks
    if bound <= free:
        return True
    return sum(kv.num_new_blocks(req, gap) for req, gap in gaps) <= free
