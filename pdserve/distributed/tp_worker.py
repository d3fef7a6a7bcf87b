"""SPMD tensor parallelism: the caller's engine is TP rank 0 and drives ranks 1..N-1 in workers.

Every rank runs an identical ``LLMEngine`` on its share of the heads. Scheduling is a
deterministic function of the calls an engine receives, so rank 0 forwards each call that changes
scheduler state (``add_request``, ``abort``, ``step``, ...) to the workers, which replay it and
discard their outputs; the models meet in the row-parallel all-reduces. Sampling agrees because
every rank computes the same full logits (replicated lm_head): greedy and seeded requests are
identical by construction, and unseeded ones draw from a default generator seeded with
``EngineConfig.seed`` on every rank.

    rank 0 (caller)                      rank r (worker process, spawned)
    LLMEngine.add_request(...) --pipe--> LLMEngine.add_request(...)
    LLMEngine.step()           --pipe--> LLMEngine.step()        (output dropped)
        model forward  <====== all_reduce (gloo on CPU, NCCL on CUDA) ======>  model forward

Wire: pickled ``(method, args, kwargs)`` tuples (ints, strings, SamplingParams dataclasses, a
prompt_embeds tensor) over a local ``multiprocessing`` pipe between our own processes only; it
never crosses a host. Rank 0 does not wait for acknowledgements; a worker that fails sends its
traceback back and exits, and rank 0 raises it at the next forwarded call.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import traceback
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from pdserve.config.engine import EngineConfig
from pdserve.distributed.parallel_state import destroy_tp, init_tp
from pdserve.errors import PdserveError

logger = logging.getLogger(__name__)

# Multicast/NVLS stays off on the shared GPU hosts (see the device README); irrelevant to gloo.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class TPWorkerError(PdserveError):
    """A tensor-parallel worker rank failed or exited; the engine cannot continue."""


def tp_backend(device: str) -> str:
    """``nccl`` for a CUDA engine, ``gloo`` for a CPU one (``device`` as in EngineConfig)."""
    if device == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class TPWorkerGroup:
    """Starts TP ranks 1..N-1, joins the TP group as rank 0, and forwards engine calls.

    Owns the worker processes and the rendezvous folder; ``close()`` stops both and leaves the
    TP group (idempotent).
    """

    def __init__(self, config: EngineConfig, load_tokenizer_: bool, timeout_s: float = 300.0) -> None:
        world = config.parallel.tensor_parallel_size
        backend = tp_backend(config.device)
        if backend == "nccl":
            for k, v in NCCL_ENV.items():
                os.environ.setdefault(k, v)  # before spawning: the workers inherit the environment
        self._dir = tempfile.mkdtemp(prefix="pdserve-tp-")
        init_method = f"file://{self._dir}/rendezvous"
        ctx = mp.get_context("spawn")  # no fork: the parent may hold threads and CUDA state
        self._conns: list[Connection] = []
        self._procs: list[BaseProcess] = []
        self._closed = False
        try:
            for rank in range(1, world):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=worker_main,
                    args=(config, rank, init_method, backend, child, load_tokenizer_, timeout_s),
                    name=f"pdserve-tp{rank}",
                    daemon=True,
                )
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            init_tp(world, 0, init_method, backend, timeout_s)
        except BaseException:
            self.close()
            raise

    def call(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Have every worker run ``engine.<method>(*args, **kwargs)``; returns without waiting."""
        self.check()
        for conn in self._conns:
            conn.send((method, args, kwargs))

    def check(self) -> None:
        """Raise TPWorkerError if a worker reported a failure or is gone."""
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs, strict=True), start=1):
            if conn.poll():  # a failure report, or end-of-file when the worker is gone
                try:
                    kind, detail = conn.recv()
                except EOFError:
                    proc.join(1.0)
                    raise TPWorkerError(f"TP rank {rank} exited with code {proc.exitcode}") from None
                raise TPWorkerError(f"TP rank {rank} failed ({kind}):\n{detail}")
            if not proc.is_alive():
                raise TPWorkerError(f"TP rank {rank} exited with code {proc.exitcode}")

    def close(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            try:
                conn.send(("close", (), {}))
            except (BrokenPipeError, OSError):
                pass  # that worker is already gone; joined below
        for rank, proc in enumerate(self._procs, start=1):
            proc.join(timeout_s)
            if proc.is_alive():
                logger.warning("TP rank %d did not exit in %.0f s; terminating it", rank, timeout_s)
                proc.terminate()
                proc.join(timeout_s)
        for conn in self._conns:
            conn.close()
        destroy_tp()
        shutil.rmtree(self._dir, ignore_errors=True)


def worker_main(
    config: EngineConfig,
    rank: int,
    init_method: str,
    backend: str,
    conn: Connection,
    load_tokenizer_: bool,
    timeout_s: float,
) -> None:
    """TP rank ``rank``: build the same engine, then replay rank 0's calls until "close"."""
    from pdserve.engine.llm_engine import LLMEngine  # the engine imports this module
    from pdserve.engine.model_runner import set_intra_op_threads

    world = config.parallel.tensor_parallel_size
    set_intra_op_threads(config, world)  # CPU ranks share the host's cores
    try:
        init_tp(world, rank, init_method, backend, timeout_s)
        engine = LLMEngine(config, load_tokenizer_=load_tokenizer_, tp_rank=rank)
        while True:
            method, args, kwargs = conn.recv()
            if method == "close":
                break
            getattr(engine, method)(*args, **kwargs)
    except EOFError:
        pass  # rank 0 went away without "close"
    except BaseException as e:  # report to rank 0, which raises it as TPWorkerError
        try:
            conn.send((type(e).__name__, traceback.format_exc()))
        except OSError:
            pass  # rank 0 is gone too; the exit code still says it
        raise
    finally:
        destroy_tp()
        conn.close()
