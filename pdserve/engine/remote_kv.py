"""The scheduler's side of P/D: requests whose KV a remote node writes or reads. No torch.

Decode side, a request with ``RemotePrefillParams`` takes no prefill: ``start_kv_load`` (at
its admission, ``waiting_queue.admit_waiting``) allocates blocks for its whole prompt, moves it
to ``Scheduler.waiting_for_kv`` (status WAITING_FOR_REMOTE_KV) and emits the ``KVLoadSpec`` the
pull writes by; ``Scheduler.finish_kv_load`` (the pull ended) moves it to the running batch,
back to the waiting queue to recompute, or ends it in error.

Prefill side, a finished request with ``RemoteDecodeParams`` keeps its blocks for the decode
node's pull when ``hold_for_transfer`` says so (``Scheduler.held_for_transfer``, freed by
``Scheduler.release_held``).
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.kvtransfer.params import KVLoadSpec, RemoteDecodeParams, RemotePrefillParams


def start_kv_load(
    kv: KVCacheManager,
    waiting_for_kv: dict[str, Request],
    req: Request,
    params: RemotePrefillParams,
    out: SchedulerOutput,
) -> bool:
    """Decode side: all prompt KV comes from the prefill node. Blocks for the whole prompt are
    allocated now; the pull writes into them. True: ``req`` is in ``waiting_for_kv`` (the caller
    takes it out of the waiting queue); False: no blocks for it (nothing changed)."""
    num_remote = req.num_prompt_tokens
    if kv.allocate_slots(req, num_remote, group_start=num_remote) is None:
        return False
    req.status = RequestStatus.WAITING_FOR_REMOTE_KV
    waiting_for_kv[req.request_id] = req
    kv.begin_inflight_write(req.request_id)
    groups = tuple(tuple(t) for t in kv.group_block_ids_views(req.request_id))
    out.kv_loads.append(KVLoadSpec(req.request_id, kv.block_ids(req.request_id), num_remote, params, groups))
    return True


def hold_for_transfer(
    kv: KVCacheManager, req: Request, on_hold: Callable[[Request, list[int]], bool] | None
) -> bool:
    """Prefill side: whether the finished ``req`` keeps its blocks for a decode node's pull
    (``on_hold`` took them: the node's transfer side knows the request)."""
    return (
        isinstance(req.kv_transfer_params, RemoteDecodeParams)
        and req.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
        and on_hold is not None
        and kv.holds(req.request_id)
        and on_hold(req, kv.block_ids(req.request_id))
    )
