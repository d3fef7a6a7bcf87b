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
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from pdserve.config.engine import EngineConfig
from pdserve.distributed.tp_worker import NCCL_ENV, tp_backend
from pdserve.engine.model_runner import ModelRunner, PendingStep, RunnerOutput
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.errors import PdserveError
from pdserve.kvtransfer.topology import split_layers
from pdserve.models.config import IntermediateTensors, ModelArchConfig

logger = logging.getLogger(__name__)


class PipelineStageError(PdserveError):
    """A pipeline stage process failed or exited; the node cannot continue."""


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
        self._procs: list[BaseProcess] = []
        self._closed = False
        self._timeout_s = config.step_timeout_s
        try:
            for rank in range(1, world):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=stage_main,
                    args=(config, rank, self.ranges, init_method, backend, child, timeout_s),
                    name=f"pdserve-pp{rank}",
                    daemon=True,
                )
                proc.start()
                child.close()
                self._conns.append(parent)
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
        for conn in self._conns:
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
) -> None:
    """Stage ``rank``: its layer slice and KV cache; runs every step the engine core sends."""
    world = len(ranges)
    last = rank == world - 1
    if backend == "gloo":  # CPU stages share the host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // world))
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
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()
