"""The scheduler's waiting queue: kept in policy order, admitted from its head. No torch.

``insert_waiting`` puts a request (new, preempted, its grammar compiled, its remote KV failed)
behind every waiting request of equal rank (``Request.sort_key``: FCFS or priority).
``admit_waiting`` is the second half of ``Scheduler.schedule``: after the running requests got
their chunks, waiting ones are admitted from the head while the token budget, ``max_num_seqs``
and the free blocks allow, and the LoRA slots (``max_loras`` distinct adapters) do. A waiting
request's prefix is first looked up (device blocks, then the offload tier); the rest of its
prompt is its first chunk, cut to the budget under chunked prefill. A decode-side request whose
prompt KV comes from a prefill node gets its blocks for a pull instead (``remote_kv``). The
first request that does not fit ends admission for the step: nothing behind it jumps the queue.
"""

from __future__ import annotations

import bisect
from typing import Protocol

from pdserve.config.engine import SchedulerConfig
from pdserve.engine.block_pool import KVCacheBlock
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.remote_kv import start_kv_load
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.kvtransfer.params import RemotePrefillParams


def insert_waiting(waiting: list[Request], req: Request, policy: str) -> None:
    """Insert ``req`` into ``waiting`` (sorted by ``sort_key(policy)``), after its equals."""
    key = req.sort_key(policy)
    keys = [r.sort_key(policy) for r in waiting]
    waiting.insert(bisect.bisect_right(keys, key), req)


class SchedulerQueues(Protocol):
    """What admission reads of the scheduler (``Scheduler`` is one), and the queues it moves
    requests between."""

    config: SchedulerConfig
    kv: KVCacheManager
    max_loras: int | None
    waiting: list[Request]
    running: list[Request]
    waiting_for_kv: dict[str, Request]


def admit_waiting(q: SchedulerQueues, budget: int, out: SchedulerOutput) -> list[tuple[Request, int]]:
    """Admit waiting requests within ``budget`` tokens: each leaves ``q.waiting`` for
    ``q.running`` (its blocks allocated, its prefix hit counted as computed) or, decode side, for
    ``q.waiting_for_kv`` (a ``KVLoadSpec`` appended to ``out``). Returns the admissions to
    ``q.running`` in order, each with its first chunk's token count."""
    cfg, kv, max_loras = q.config, q.kv, q.max_loras
    waiting, running, waiting_for_kv = q.waiting, q.running, q.waiting_for_kv
    admitted: list[tuple[Request, int]] = []
    while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
        req = waiting[0]
        if (
            req.lora_name
            and max_loras is not None
            and lora_slots_full(running, waiting_for_kv, max_loras, req.lora_name)
        ):
            break  # its adapter needs a slot no running request's adapter gives up yet
        params = req.kv_transfer_params
        if (
            isinstance(params, RemotePrefillParams)
            and req.num_computed_tokens == 0
            and req.num_preemptions == 0
        ):
            if not start_kv_load(kv, waiting_for_kv, req, params, out):
                break
            waiting.pop(0)
            continue
        hit_blocks: list[KVCacheBlock] = []
        num_hit = 0
        off = None
        # A prefix hit has no logits: prompt logprobs need every prompt position computed.
        if req.num_computed_tokens == 0 and req.sampling_params.prompt_logprobs is None:
            hit_blocks, num_hit = kv.get_computed_blocks(req)
            # Blocks past the device hit that the offload tier holds: loaded into new blocks
            # (looked up only when the rest of the prompt fits: a request that waits for
            # memory would read and pin them again every step).
            if kv.pool.num_free_blocks >= kv.num_blocks_needed(req.num_tokens) - len(hit_blocks):
                off = kv.get_offloaded_blocks(req, len(hit_blocks))
        num_off = off.num_tokens if off is not None else 0
        num_new = req.num_tokens - req.num_computed_tokens - num_hit - num_off
        if num_new > budget:
            if not cfg.enable_chunked_prefill:
                if off is not None:
                    kv.offload.cancel(off)  # type: ignore[union-attr]
                break
            num_new = budget
        if kv.allocate_slots(req, num_off + num_new, hit_blocks, num_hit) is None:
            if off is not None:
                kv.offload.cancel(off)  # type: ignore[union-attr]
            break
        if off is not None:
            first = len(hit_blocks)
            ids = kv.block_ids_view(req.request_id)[first : first + len(off.slots)]
            kv.offload.commit(off, ids, out.step_seq)  # type: ignore[union-attr]
            num_hit += num_off
        waiting.pop(0)
        if req.num_preemptions == 0 or req.num_cached_tokens == 0:
            req.num_cached_tokens = max(req.num_cached_tokens, num_hit)
        req.num_computed_tokens += num_hit
        req.status = RequestStatus.RUNNING
        running.append(req)
        admitted.append((req, num_new))
        budget -= num_new
    return admitted


def lora_slots_full(
    running: list[Request], waiting_for_kv: dict[str, Request], max_loras: int, lora_name: str
) -> bool:
    """Whether admitting a request of ``lora_name`` would make the running adapters exceed max_loras."""
    active = {r.lora_name for r in running if r.lora_name}
    active.update(r.lora_name for r in waiting_for_kv.values() if r.lora_name)
    return lora_name not in active and len(active) >= max_loras
