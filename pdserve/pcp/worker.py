"""A PCP worker rank's process: join the group, build its runner, run rank 0's commands.

The commands are the engine's worker protocol (``pdserve.engine.workers``): ``SizeKVCache``
(replied with this rank's ``CacheSizes``), ``InitKVCache`` (``Ack``), ``ExecuteStep`` (launch
and wait; no reply: rank 0's samples are the engine's), ``DropFinished``, ``Shutdown``, and
PCP's own ``DrafterAfterStep`` (an MTP module's KV of the last step, with rank 0's tokens) and
``DraftForward`` (this rank's part of a draft model's split catch-up). A
failure is reported as ``WorkerFailed`` before the process exits (``pdserve.distributed.workers``).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from pdserve.config.engine import EngineConfig
from pdserve.distributed.workers import Ack, Shutdown, WorkerFailed
from pdserve.engine.device import set_intra_op_threads
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.workers import DropFinished, ExecuteStep, InitKVCache, SizeKVCache
from pdserve.pcp.exchange import destroy_pcp_group, init_pcp_group
from pdserve.pcp.runner import DrafterAfterStep, DraftForward, PCPRankRunner


@dataclass(frozen=True)
class PCPWorkerSpec:
    config: EngineConfig
    world: int  # PCP ranks, rank 0 included
    group_timeout_s: float  # joining the torch.distributed group, and each collective


def pcp_worker_main(
    rank: int,
    init_method: str,
    backend: str,
    conn: Connection,
    xconn: Connection | None,
    spec: PCPWorkerSpec,
) -> None:
    """``WorkerGroup``'s target for PCP rank ``rank`` (``xconn``: no transfer pipe, unused)."""
    assert xconn is None, "PCP ranks move no KV themselves: rank 0's cache holds every block"
    set_intra_op_threads(spec.config, spec.world)
    runner: PCPRankRunner | None = None
    try:
        init_pcp_group(spec.world, rank, init_method, backend, spec.group_timeout_s)
        torch.manual_seed(spec.config.seed)  # unseeded sampling draws as rank 0's
        runner = PCPRankRunner(spec.config, rank, spec.world)
        _serve(runner, conn)
    except EOFError:
        pass  # rank 0's process went away without Shutdown
    except BaseException as e:  # reported to rank 0, which raises PCPWorkerError naming this rank
        try:
            conn.send(WorkerFailed(type(e).__name__, traceback.format_exc()))
        except OSError:
            pass  # rank 0 is gone too; the exit code still says it
        raise
    finally:
        if runner is not None:
            runner.close()
        destroy_pcp_group()
        conn.close()


def _serve(runner: PCPRankRunner, conn: Connection) -> None:
    last: SchedulerOutput | None = None  # the last step run (a drafter's after_step reads it)
    while True:
        match conn.recv():
            case ExecuteStep(sched=sched):
                runner.launch(sched).result()  # rank 0's samples are the engine's
                last = sched
            case DrafterAfterStep(sampled=sampled, spec_sampled=spec_sampled, drafting_off=off):
                assert runner.drafter is not None and last is not None, "after_step with no drafter or step"
                runner.drafter.after_step(last, sampled, spec_sampled, off)
            case DraftForward(rows=rows):
                assert runner.drafter is not None, "a split draft forward with no drafter"
                runner.drafter.peer_forward(rows)
            case DropFinished(request_ids=request_ids):
                runner.drop_finished(request_ids)
            case SizeKVCache():
                conn.send(runner.determine_cache_sizes())
            case InitKVCache(num_blocks=num_blocks):
                runner.init_kv_cache(num_blocks)
                conn.send(Ack())
            case Shutdown():
                return
            case msg:
                raise AssertionError(f"PCP rank: unknown command {msg!r}")
