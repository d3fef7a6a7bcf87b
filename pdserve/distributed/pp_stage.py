"""Pipeline parallelism beneath the engine: one scheduler per node, one model slice per stage.

The engine core (scheduler + KV cache manager) stays in the caller's process, which also runs
stage 0; stages 1..N-1 are spawned worker processes, each with its own ``ModelRunner`` over a
contiguous layer slice (``topology.split_layers``) and its own KV cache tensor with the same
number of blocks (one block table per node: block ids mean the same on every stage).

    engine core + stage 0                stage 1 (process)            stage N-1 (process)
    sched = scheduler.schedule()
    --pipe: ("step", sched)------------> recv sched          ...      recv sched
    stage 0 forward -- dist.send ------> dist.recv, forward -- ... -> dist.recv, forward, sample
    <---------------------------------------------------------- pipe: sampled tokens, logprobs

Hidden states and the residual pass with ``torch.distributed`` point-to-point send/recv (gloo on
CPU, NCCL on CUDA), shape first so a stage need not re-derive token counts. The pipe carries our
own pickled dataclasses (SchedulerOutput, RunnerOutput) between processes of one node only.
A stage that dies or fails raises ``PipelineStageError`` at the next call: the engine fails its
requests and the node turns NOT_SERVING (``services.node``).

KV transfer (prefill / decode nodes): ``start_kv_endpoints`` makes every stage process
open its own transfer engine (Mooncake) and register its own KV cache there; it answers with its
session address and regions (``StageEndpoint``). Decode stages then only receive (peers write
into their registered memory). Prefill stages write on command: a second pipe per stage (the
"transfer pipe", separate from the step pipe the engine thread owns) carries
``("write", peer_session, descriptors, transfer_id)`` to a thread in the stage process, which
runs the write with the stage's own engine and answers ``ok`` or the error. ``StageWriteBackend``
is that pipe seen as a ``TransferBackend``, so one ``KVProducer`` per stage works unchanged.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from pdserve.config.engine import EngineConfig
from pdserve.distributed.tp_worker import NCCL_ENV, tp_backend
from pdserve.engine.model_runner import ModelRunner, PendingStep, RunnerOutput, set_intra_op_threads
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.errors import PdserveError
from pdserve.kvtransfer.backend import TransferBackend, TransferError
from pdserve.kvtransfer.regions import Descriptor, Region
from pdserve.kvtransfer.topology import split_layers
from pdserve.models.config import IntermediateTensors, ModelArchConfig

logger = logging.getLogger(__name__)


class PipelineStageError(PdserveError):
    """A pipeline stage process failed or exited; the node cannot continue."""


STAGE_WRITE_TIMEOUT_S = 120.0  # one write a stage process runs for the node's PushKV


@dataclass(frozen=True)
class StageEndpoint:
    """One stage's KV transfer endpoint: its layers, its engine's session, its KV regions."""

    pp_rank: int
    pp_size: int
    layer_start: int
    layer_end: int
    session: str
    regions: tuple[Region, ...]


def stage_ranges(config: EngineConfig) -> list[tuple[int, int]]:
    """The layer range of every stage of this engine (ConfigError naming the values if unsplittable)."""
    arch = ModelArchConfig.from_model_dir(config.model)
    par = config.parallel
    return split_layers(arch.num_hidden_layers, par.pipeline_parallel_size, par.pp_layer_split)


def _send_tensors(t: IntermediateTensors, dst: int) -> None:
    shape = torch.tensor(list(t.hidden_states.shape), dtype=torch.int64)
    dist.send(shape, dst)
    dist.send(t.hidden_states.contiguous(), dst)
    dist.send(t.residual.contiguous(), dst)


def _recv_tensors(src: int, dtype: torch.dtype, device: torch.device) -> IntermediateTensors:
    shape = torch.empty(2, dtype=torch.int64)
    dist.recv(shape, src)
    dims = [int(x) for x in shape.tolist()]
    hidden = torch.empty(dims, dtype=dtype, device=device)
    residual = torch.empty(dims, dtype=dtype, device=device)
    dist.recv(hidden, src)
    dist.recv(residual, src)
    return IntermediateTensors(hidden, residual)


class _DoneStep(PendingStep):
    """A step already computed end to end (PP runs synchronously): ``result()`` returns it."""

    def __init__(self, out: RunnerOutput) -> None:
        super().__init__(req_ids=[], samples=None, event=None)
        self.out = out

    def result(self) -> RunnerOutput:
        return self.out


class PipelineRunner:
    """Drop-in for ``ModelRunner`` in the engine core when ``pipeline_parallel_size`` > 1."""

    def __init__(self, config: EngineConfig, timeout_s: float = 300.0) -> None:
        self.ranges = stage_ranges(config)  # before any process starts: a bad pp fails fast
        world = len(self.ranges)
        backend = tp_backend(config.device)
        if backend == "nccl":
            for k, v in NCCL_ENV.items():
                os.environ.setdefault(k, v)
        self._dir = tempfile.mkdtemp(prefix="pdserve-pp-")
        init_method = f"file://{self._dir}/rendezvous"
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._xconns: list[Connection] = []  # transfer pipes (KV writes), one per stage process
        self._xlocks: list[threading.Lock] = []
        self._procs: list[BaseProcess] = []
        self._closed = False
        self._timeout_s = config.step_timeout_s
        try:
            for rank in range(1, world):
                parent, child = ctx.Pipe()
                xparent, xchild = ctx.Pipe()
                proc = ctx.Process(
                    target=stage_main,
                    args=(config, rank, self.ranges, init_method, backend, child, timeout_s, xchild),
                    name=f"pdserve-pp{rank}",
                    daemon=True,
                )
                proc.start()
                child.close()
                xchild.close()
                self._conns.append(parent)
                self._xconns.append(xparent)
                self._xlocks.append(threading.Lock())
                self._procs.append(proc)
            dist.init_process_group(
                backend,
                init_method=init_method,
                world_size=world,
                rank=0,
                timeout=timedelta(seconds=timeout_s),
            )
            self.stage0 = ModelRunner(config, *self.ranges[0])
        except BaseException:
            self.close()
            raise
        self.config = config
        self.arch = self.stage0.arch
        self.device = self.stage0.device
        self.dtype = self.stage0.dtype
        self.block_size = self.stage0.block_size
        self.model = self.stage0.model  # stage 0's slice: not a whole model (async scheduling off)

    @property
    def num_stages(self) -> int:
        return len(self.ranges)

    @property
    def kv_cache(self) -> torch.Tensor | None:
        return self.stage0.kv_cache

    def determine_cache_sizes(self) -> Any:
        """Stage 0's sizing; every stage allocates that many blocks for its own layers (with the
        default even split stage 0 holds the most layers, so no stage exceeds the budget)."""
        return self.stage0.determine_cache_sizes()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.stage0.init_kv_cache(num_blocks)
        self._call_all("init_kv", num_blocks)
        for rank in range(1, self.num_stages):
            self._wait_reply(rank)

    def start_kv_endpoints(self, kv_transport: str, kv_host: str) -> list[StageEndpoint]:
        """Stages 1..N-1 open their own transfer engine and register their KV cache (after
        ``init_kv_cache``, before the engine thread starts); returns their endpoints."""
        self._call_all("kv_endpoint", kv_transport, kv_host)
        out = []
        for rank in range(1, self.num_stages):
            session, regions = self._wait_reply(rank)
            lo, hi = self.ranges[rank]
            out.append(
                StageEndpoint(
                    rank, self.num_stages, lo, hi, session, tuple(Region.from_dict(r) for r in regions)
                )
            )
        return out

    def stage_write(
        self, rank: int, peer_session: str, descs: Sequence[Descriptor], transfer_id: str
    ) -> None:
        """Stage ``rank`` (>= 1) writes ``descs`` (its own memory -> the peer's) with its engine.
        Raises TransferError if the write failed, PipelineStageError if the stage is gone."""
        conn = self._xconns[rank - 1]
        with self._xlocks[rank - 1]:
            try:
                conn.send(("write", peer_session, list(descs), transfer_id))
            except (BrokenPipeError, OSError) as e:
                raise PipelineStageError(f"pipeline stage {rank} is gone: {e}") from e
            deadline = time.monotonic() + STAGE_WRITE_TIMEOUT_S
            while not conn.poll(0.05):
                if not self._procs[rank - 1].is_alive():
                    raise PipelineStageError(
                        f"pipeline stage {rank} exited ({self._exit_code(rank)}) during a KV write"
                    )
                if time.monotonic() > deadline:
                    raise PipelineStageError(
                        f"pipeline stage {rank} did not finish a KV write in {STAGE_WRITE_TIMEOUT_S:.0f} s"
                    )
            try:
                kind, payload = conn.recv()
            except EOFError:
                raise PipelineStageError(f"pipeline stage {rank} exited ({self._exit_code(rank)})") from None
        if kind != "ok":
            raise TransferError(peer_session, transfer_id, f"write from pipeline stage {rank}", None, payload)

    def launch(self, sched: SchedulerOutput, intermediate: IntermediateTensors | None = None) -> _DoneStep:
        assert intermediate is None
        self._call_all("step", sched)
        out = self.stage0.launch(sched).result()
        assert out.intermediate is not None
        try:
            _send_tensors(out.intermediate, 1)
        except RuntimeError as e:  # gloo/NCCL: the peer stage is gone
            time.sleep(0.2)  # let the dead process be reaped so the error names it
            self.check_alive()
            raise PipelineStageError(f"sending hidden states to pipeline stage 1 failed: {e}") from e
        sampled, logprobs, prompt_logprobs = self._wait_reply(self.num_stages - 1)
        return _DoneStep(RunnerOutput(sampled, logprobs, prompt_logprobs=prompt_logprobs))

    def drop_finished(self, request_ids: list[str]) -> None:
        self.stage0.drop_finished(request_ids)
        if request_ids:
            self._call_all("drop", request_ids)

    def _call_all(self, method: str, *args: Any) -> None:
        self.check()
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send((method, args))
            except (BrokenPipeError, OSError) as e:
                raise PipelineStageError(f"pipeline stage {rank} is gone: {e}") from e

    def _wait_reply(self, rank: int) -> Any:
        """The reply of stage ``rank``; PipelineStageError if any stage fails or dies meanwhile."""
        conn = self._conns[rank - 1]
        deadline = time.monotonic() + self._timeout_s
        while not conn.poll(0.05):
            self.check_alive()
            if time.monotonic() > deadline:
                raise PipelineStageError(f"pipeline stage {rank} did not answer in {self._timeout_s:.0f} s")
        try:
            kind, payload = conn.recv()
        except EOFError:
            raise PipelineStageError(f"pipeline stage {rank} exited ({self._exit_code(rank)})") from None
        if kind != "ok":
            raise PipelineStageError(f"pipeline stage {rank} failed ({kind}):\n{payload}")
        return payload

    def _exit_code(self, rank: int) -> str:
        proc = self._procs[rank - 1]
        proc.join(0.5)
        return f"exit code {proc.exitcode}"

    def check_alive(self) -> None:
        """Raise PipelineStageError naming a stage process that is gone (with its report, if any)."""
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs, strict=True), start=1):
            if not proc.is_alive():
                detail = ""
                if conn.poll():
                    try:
                        detail = f": {conn.recv()[1]}"
                    except (EOFError, OSError):
                        pass  # it died without a report; the exit code says it
                raise PipelineStageError(f"pipeline stage {rank} exited ({self._exit_code(rank)}){detail}")

    def check(self) -> None:
        """Raise PipelineStageError if a stage reported a failure or is gone (between steps, when
        no reply is outstanding)."""
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs, strict=True), start=1):
            if conn.poll():
                try:
                    kind, payload = conn.recv()
                except EOFError:
                    raise PipelineStageError(
                        f"pipeline stage {rank} exited ({self._exit_code(rank)})"
                    ) from None
                raise PipelineStageError(f"pipeline stage {rank} failed ({kind}):\n{payload}")
            if not proc.is_alive():
                raise PipelineStageError(f"pipeline stage {rank} exited ({self._exit_code(rank)})")

    def stage_pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def close(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            try:
                conn.send(("close", ()))
            except (BrokenPipeError, OSError):
                pass  # that stage is already gone; joined below
        for rank, proc in enumerate(self._procs, start=1):
            proc.join(timeout_s)
            if proc.is_alive():
                logger.warning("pipeline stage %d did not exit in %.0f s; terminating it", rank, timeout_s)
                proc.terminate()
                proc.join(timeout_s)
        for conn in (*self._conns, *self._xconns):
            conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._dir, ignore_errors=True)


def stage_main(
    config: EngineConfig,
    rank: int,
    ranges: list[tuple[int, int]],
    init_method: str,
    backend: str,
    conn: Connection,
    timeout_s: float,
    xconn: Connection | None = None,
) -> None:
    """Stage ``rank``: its layer slice and KV cache; runs every step the engine core sends."""
    world = len(ranges)
    kv_backend: TransferBackend | None = None
    last = rank == world - 1
    set_intra_op_threads(config, world)  # CPU stages share the host's cores
    try:
        dist.init_process_group(
            backend,
            init_method=init_method,
            world_size=world,
            rank=rank,
            timeout=timedelta(seconds=timeout_s),
        )
        runner = ModelRunner(config, *ranges[rank])
        while True:
            method, args = conn.recv()
            if method == "close":
                break
            if method == "init_kv":
                runner.init_kv_cache(args[0])
                conn.send(("ok", None))
            elif method == "kv_endpoint":
                from pdserve.kvtransfer.connector import kv_regions_of
                from pdserve.kvtransfer.factory import make_backend

                cache = runner.kv_cache
                assert cache is not None, "kv_endpoint before init_kv"
                kv_backend = make_backend(args[0], args[1], str(runner.device))
                kv_backend.register(cache.data_ptr(), cache.numel() * cache.element_size())
                regions = [r.to_dict() for r in kv_regions_of(runner)]
                if xconn is not None:
                    threading.Thread(
                        target=_serve_writes, args=(kv_backend, xconn), name=f"pp{rank}-kv", daemon=True
                    ).start()
                conn.send(("ok", (kv_backend.session_id, regions)))
            elif method == "drop":
                runner.drop_finished(args[0])
            elif method == "step":
                sched: SchedulerOutput = args[0]
                inter = _recv_tensors(rank - 1, runner.dtype, runner.device)
                out = runner.launch(sched, inter).result()
                if last:
                    conn.send(("ok", (out.sampled, out.logprobs, out.prompt_logprobs)))
                else:
                    assert out.intermediate is not None
                    _send_tensors(out.intermediate, rank + 1)
            else:
                raise AssertionError(f"unknown pipeline stage call {method!r}")
    except EOFError:
        pass  # the engine core went away without "close"
    except BaseException as e:  # report to the engine core, which raises PipelineStageError
        try:
            conn.send((type(e).__name__, traceback.format_exc()))
        except OSError:
            pass
        raise
    finally:
        if kv_backend is not None:
            kv_backend.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def _serve_writes(backend: TransferBackend, xconn: Connection) -> None:
    """Stage process thread: run the KV writes the node's process asks for, one at a time."""
    while True:
        try:
            msg = xconn.recv()
        except (EOFError, OSError):
            return  # the node's process went away
        op, peer, descs, tid = msg
        assert op == "write", op
        try:
            backend.write(peer, descs, transfer_id=tid)
            reply: tuple[str, Any] = ("ok", None)
        except Exception as e:  # reported to the node, which counts the push as failed
            reply = ("error", str(e))
        try:
            xconn.send(reply)
        except (BrokenPipeError, OSError):
            return


class StageWriteBackend(TransferBackend):
    """Stage ``rank``'s transfer engine as seen from the node's process: writes go through the
    transfer pipe (``PipelineRunner.stage_write``); memory is registered in the stage process."""

    def __init__(self, runner: PipelineRunner, endpoint: StageEndpoint) -> None:
        self._runner = runner
        self._endpoint = endpoint

    @property
    def session_id(self) -> str:
        return self._endpoint.session

    def register(self, addr: int, length: int) -> None:
        raise NotImplementedError("a stage's KV is registered in its own process")

    def unregister(self, addr: int) -> None:
        raise NotImplementedError("a stage's KV is registered in its own process")

    def write(self, peer_session: str, descs: Sequence[Descriptor], *, transfer_id: str) -> None:
        self._runner.stage_write(self._endpoint.pp_rank, peer_session, descs, transfer_id)

    def close(self) -> None:
        pass  # the stage process closes its engine when it exits
