"""Preemption by recompute: which running request gives up its blocks, and what that undoes.

``Scheduler.schedule`` preempts when a running request cannot get a block (and the victim's
blocks can be freed now): ``pick_victim`` names the lowest-ranked running request, ``preempt``
frees its blocks, resets its counter to 0 and puts it back in the waiting queue, to be
computed again from its prompt and the tokens it has. No torch.
"""

from __future__ import annotations

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from pdserve.engine.waiting_queue import insert_waiting


def pick_victim(running: list[Request], policy: str) -> Request:
    # The lowest-ranked running request: the last by policy order.
    return max(running, key=lambda r: r.sort_key(policy))


def preempt(
    victim: Request,
    running: list[Request],
    waiting: list[Request],
    policy: str,
    kv: KVCacheManager,
    scheduled: dict[str, ScheduledChunk],
    out: SchedulerOutput,
) -> None:
    """Preempt ``victim``: its chunk leaves ``scheduled``, its blocks are freed, it moves from
    ``running`` to ``waiting`` (in ``policy`` order) and ``out.preempted_req_ids`` names it."""
    scheduled.pop(victim.request_id, None)
    running.remove(victim)
    kv.free(victim.request_id)
    # can_free_now() passed, so no step in flight computes for the victim.
    assert victim.num_output_placeholders == 0, victim.request_id
    victim.status = RequestStatus.PREEMPTED
    victim.num_computed_tokens = 0
    victim.num_preemptions += 1
    insert_waiting(waiting, victim, policy)
    out.preempted_req_ids.append(victim.request_id)
