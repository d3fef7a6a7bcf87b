"""The engine's worker protocol: what a TP rank or a pipeline stage is told, and its loop.

One protocol for both: the engine core (scheduler, KV cache manager) lives only in the node's
process, which is also TP rank 0 or pipeline stage 0; every other rank or stage is a worker
process running a ``ModelRunner`` (the whole model with its share of the heads, or a layer
slice) and executing what the core scheduled. Commands are typed dataclasses; a worker answers
with a reply dataclass (``Ack``, ``KVEndpoint``, ``StepResult``) or ``WorkerFailed`` before it
exits (``pdserve.distributed.workers``).

    command          TP rank                               pipeline stage
    SizeKVCache      determine_cache_sizes (collective)    -
    InitKVCache      allocate; Ack                         allocate; Ack
    RegisterKV       -                                     own transfer engine; KVEndpoint
    ExecuteStep      offload copies, launch (as rank 0     offload copies, recv hidden,
                     did); no reply                        forward, send on; the last
                                                           stage: StepResult
    DropFinished     forget finished requests' state       the same
    InitKVOffload    map the offload pool; Ack             the same
    StoreKVBlocks    offload stores now; Ack               the same
    WriteKV          -                                     (transfer pipe) write; Ack/WriteFailed
    Shutdown         exit                                  exit

The pipes are ``multiprocessing`` pipes between processes of one node (the node spawned them):
their pickles never come from the network.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pdserve.config.engine import EngineConfig
from pdserve.distributed.parallel_state import destroy_tp, init_tp
from pdserve.distributed.workers import Ack, Shutdown, WorkerFailed
from pdserve.engine.device import set_intra_op_threads
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.pending_step import PendingStep
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.kvoffload.copier import KVOffloadCopier
from pdserve.kvoffload.stages import InitKVOffload, StoreKVBlocks, run_stage_copies, stage_copier
from pdserve.kvtransfer.backend import TransferBackend
from pdserve.kvtransfer.head_slices import HeadGather
from pdserve.kvtransfer.regions import Descriptor
from pdserve.models.config import IntermediateTensors

if TYPE_CHECKING:
    from pdserve.kvtransfer.staging import Stager


class WorkerRole(enum.Enum):
    TP_RANK = "TP rank"
    PP_STAGE = "pipeline stage"


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process builds: its role, the group size, the layers and a timeout."""

    config: EngineConfig
    role: WorkerRole
    world: int
    stage_layers: tuple[tuple[int, int], ...] = ()  # PP: every stage's [start, end) layers
    group_timeout_s: float = 300.0  # joining the torch.distributed group


# -- commands -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SizeKVCache:
    """Size the KV cache (TP: every rank takes the smallest budget of all, a collective)."""


@dataclass(frozen=True)
class InitKVCache:
    num_blocks: int


@dataclass(frozen=True)
class RegisterKV:
    """Open this stage's own transfer engine and register its KV cache there."""

    kv_transport: str
    kv_host: str


@dataclass(frozen=True)
class ExecuteStep:
    """Run the step the engine core scheduled. ``defer_masks`` and ``overlaps`` repeat how the
    engine launched it (asynchronous scheduling; ``overlaps``: the previous step was still in
    flight, so its tokens are not in ``sched``'s token histories yet: a TP rank or the last
    stage, which sample, append their own samples of it first)."""

    sched: SchedulerOutput
    defer_masks: bool = False
    overlaps: bool = False


@dataclass(frozen=True)
class DropFinished:
    request_ids: list[str]


@dataclass(frozen=True)
class WriteKV:
    """Write ``descs`` (this stage's memory -> the peer's) with this stage's transfer engine."""

    peer_session: str
    descs: list[Descriptor]
    transfer_id: str
    gather: HeadGather | None = None  # pack these heads first; descs are relative to the pack


# -- replies ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVEndpoint:
    session: str
    regions: list[dict[str, Any]]  # Region.to_dict() of each


@dataclass(frozen=True)
class StepResult:
    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprob]
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)


@dataclass(frozen=True)
class WriteFailed:
    error: str


def send_tensors(t: IntermediateTensors, dst: int) -> None:
    # on the tensors' device: NCCL moves device tensors only, gloo host ones
    shape = torch.tensor(list(t.hidden_states.shape), dtype=torch.int64, device=t.hidden_states.device)
    dist.send(shape, dst)
    dist.send(t.hidden_states.contiguous(), dst)
    dist.send(t.residual.contiguous(), dst)


def recv_tensors(src: int, dtype: torch.dtype, device: torch.device) -> IntermediateTensors:
    shape = torch.empty(2, dtype=torch.int64, device=device)
    dist.recv(shape, src)
    dims = [int(x) for x in shape.tolist()]
    hidden = torch.empty(dims, dtype=dtype, device=device)
    residual = torch.empty(dims, dtype=dtype, device=device)
    dist.recv(hidden, src)
    dist.recv(residual, src)
    return IntermediateTensors(hidden, residual)


class _Worker:
    """The state of one worker process between commands."""

    def __init__(self, spec: WorkerSpec, rank: int, conn: Connection, xconn: Connection | None) -> None:
        self.spec, self.rank, self.conn, self.xconn = spec, rank, conn, xconn
        layers = spec.stage_layers[rank] if spec.stage_layers else (0, None)
        self.runner = ModelRunner(spec.config, *layers)
        self.kv_backend: TransferBackend | None = None
        self.inflight: PendingStep | None = None  # TP under asynchronous scheduling
        self.last_sampled: dict[str, int] = {}  # the last pipeline stage's previous samples
        self.offload: KVOffloadCopier | None = None  # this stage's copier of the offload tier

    def handle(self, msg: object) -> None:
        runner = self.runner
        if isinstance(msg, ExecuteStep):
            if self.spec.role is WorkerRole.PP_STAGE:
                self.stage_step(msg)
            else:
                self.rank_step(msg)
        elif isinstance(msg, DropFinished):
            runner.drop_finished(msg.request_ids)
        elif isinstance(msg, SizeKVCache):
            runner.determine_cache_sizes()
        elif isinstance(msg, InitKVCache):
            runner.init_kv_cache(msg.num_blocks)
            self.conn.send(Ack())
        elif isinstance(msg, RegisterKV):
            self.conn.send(self.register_kv(msg))
        elif isinstance(msg, InitKVOffload):
            self.offload = stage_copier(msg, runner, self.rank)
            self.conn.send(Ack())
        elif isinstance(msg, StoreKVBlocks):
            assert self.offload is not None, "StoreKVBlocks before InitKVOffload"
            run_stage_copies(self.offload, msg.spec)
            self.conn.send(Ack())
        else:
            raise AssertionError(f"{self.spec.role.value} {self.rank}: unknown command {msg!r}")

    def stage_step(self, msg: ExecuteStep) -> None:
        runner, rank = self.runner, self.rank
        last = rank == self.spec.world - 1
        if last and msg.overlaps:  # the step before is in flight for the engine: not in sched yet
            _append_in_flight(msg.sched, self.last_sampled)
        self.offload_copies(msg.sched)
        inter = recv_tensors(rank - 1, runner.dtype, runner.device)
        out = runner.launch(msg.sched, inter).result()
        if last:
            self.last_sampled = out.sampled
            self.conn.send(StepResult(out.sampled, out.logprobs, out.prompt_logprobs))
        else:
            assert out.intermediate is not None
            send_tensors(out.intermediate, rank + 1)

    def offload_copies(self, sched: SchedulerOutput) -> None:
        """Stores of evicted blocks and loads of offload hits, before this process's forward."""
        if sched.kv_offload:
            assert self.offload is not None, "an offload copy before InitKVOffload"
            run_stage_copies(self.offload, sched.kv_offload)

    def rank_step(self, msg: ExecuteStep) -> None:
        """The launch rank 0 made, in the same order against the step before (its samples feed
        this one's in-flight rows and, for grammar rows, advance the matchers first), so every
        rank samples the same tokens: logits are replicated and generators seeded alike."""
        runner = self.runner
        self.offload_copies(msg.sched)
        prev, self.inflight = self.inflight, None
        if prev is not None and not msg.overlaps:  # rank 0 had read it before this launch
            prev.result()
            prev = None
        pending = runner.launch(msg.sched, defer_masks=msg.defer_masks)
        if not msg.defer_masks:
            pending.result()
            return
        self.inflight = pending
        if prev is None:
            if pending.deferred is not None:
                runner.sample_deferred(pending)
            return
        out = prev.result()
        if pending.deferred is None:
            return
        runner.prepare_deferred_sampled(pending, out.sampled)
        _append_in_flight(msg.sched, out.sampled)
        runner.prepare_deferred(pending)
        runner.sample_deferred(pending)

    def register_kv(self, msg: RegisterKV) -> KVEndpoint:
        from pdserve.kvtransfer.factory import make_backend
        from pdserve.kvtransfer.runner_kv import kv_regions_of

        cache = self.runner.kv_cache
        assert cache is not None, "RegisterKV before InitKVCache"
        self.kv_backend = backend = make_backend(msg.kv_transport, msg.kv_host, str(self.runner.device))
        backend.register(cache.data_ptr(), cache.numel() * cache.element_size())
        if self.xconn is not None:
            from pdserve.kvtransfer.staging import Stager

            threading.Thread(
                target=_serve_writes,
                args=(backend, Stager(backend, cache), self.xconn),
                name=f"worker{self.rank}-kv",
                daemon=True,
            ).start()
        return KVEndpoint(backend.session_id, [r.to_dict() for r in kv_regions_of(self.runner)])


def _append_in_flight(sched: SchedulerOutput, sampled: dict[str, int]) -> None:
    """Append the previous step's samples to ``sched``'s copies of the token histories, as the
    engine's ``update_from_output`` did after it pickled them."""
    for chunk in sched.chunks:
        req = chunk.request
        token = sampled.get(req.request_id)
        if token is not None:
            req.output_token_ids.append(token)
            req.num_output_placeholders -= 1


def worker_main(
    rank: int,
    init_method: str,
    backend: str,
    conn: Connection,
    xconn: Connection | None,
    spec: WorkerSpec,
) -> None:
    """A worker process (``WorkerGroup``'s target): join the group, build the runner, then run
    commands until ``Shutdown``."""
    set_intra_op_threads(spec.config, spec.world)  # CPU workers share the host's cores
    worker: _Worker | None = None
    try:
        if spec.role is WorkerRole.TP_RANK:
            init_tp(spec.world, rank, init_method, backend, spec.group_timeout_s)
            torch.manual_seed(spec.config.seed)  # unseeded sampling draws the same on every rank
        else:
            timeout = timedelta(seconds=spec.group_timeout_s)
            dist.init_process_group(
                backend, init_method=init_method, world_size=spec.world, rank=rank, timeout=timeout
            )
        worker = _Worker(spec, rank, conn, xconn)
        while not isinstance(msg := conn.recv(), Shutdown):
            worker.handle(msg)
    except EOFError:
        pass  # the engine's process went away without Shutdown
    except BaseException as e:  # reported to the engine, which raises the group's error
        import traceback

        try:
            conn.send(WorkerFailed(type(e).__name__, traceback.format_exc()))
        except OSError:
            pass  # the engine's process is gone too; the exit code still says it
        raise
    finally:
        if worker is not None and worker.kv_backend is not None:
            worker.kv_backend.close()
        destroy_tp()
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def _serve_writes(backend: TransferBackend, stager: Stager, xconn: Connection) -> None:
    """Worker thread: run the KV writes the node's process asks for, one at a time."""
    while True:
        try:
            msg = xconn.recv()
        except (EOFError, OSError):
            return  # the node's process went away
        assert isinstance(msg, WriteKV), msg
        reply: Ack | WriteFailed
        try:
            if msg.gather is not None:
                stager.write_gathered(msg.peer_session, msg.gather, msg.descs, transfer_id=msg.transfer_id)
            else:
                backend.write(msg.peer_session, msg.descs, transfer_id=msg.transfer_id)
            reply = Ack()
        except Exception as e:  # reported to the node, which counts the push as failed
            reply = WriteFailed(str(e))
        try:
            xconn.send(reply)
        except (BrokenPipeError, OSError):
            return
