"""Worker processes of one engine: TP ranks 1..N-1 or pipeline stages 1..N-1, one protocol.

``WorkerGroup`` spawns the workers (``spawn``, never ``fork``: the parent may hold threads and
CUDA state), gives each a command pipe and, optionally, a transfer pipe (KV writes run on a
thread of their own in the worker), and owns the rendezvous folder of their
``torch.distributed`` group. ``close()`` is the one way down: ``Shutdown`` to every worker, a join
with a timeout, then terminate.

Messages are typed dataclasses (the engine's are in ``pdserve.engine.workers``); a worker answers
with a reply dataclass, or with ``WorkerFailed`` (its traceback) before it exits. The pipes are
``multiprocessing`` pipes between processes of one node that the node started itself: what
crosses them is pickled, and nothing read from the network is ever unpickled here.

This module knows nothing of the engine: it is the floor beneath it (the engine's worker loop,
``pdserve.engine.workers.worker_main``, is the ``target`` it starts).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from pdserve.errors import PdserveError

logger = logging.getLogger(__name__)

# Multicast/NVLS stays off on the shared GPU hosts (see the device README); irrelevant to gloo.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class WorkerError(PdserveError):
    """A worker process failed or exited; the engine cannot continue."""


class TPWorkerError(WorkerError):
    """A tensor-parallel worker rank failed or exited."""


class PipelineStageError(WorkerError):
    """A pipeline stage process failed or exited."""


@dataclass(frozen=True)
class Shutdown:
    """Leave the command loop, release the group and exit (no reply)."""


@dataclass(frozen=True)
class Ack:
    """A command that returns nothing has finished (or a value-less reply)."""


@dataclass(frozen=True)
class WorkerFailed:
    """The worker raised: its exception's type and traceback; it exits after sending this."""

    kind: str
    traceback: str


def dist_backend(device: str) -> str:
    """``nccl`` for a CUDA engine, ``gloo`` for a CPU one (``device`` as in EngineConfig)."""
    if device == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class WorkerGroup:
    """Workers 1..``world``-1 of one engine (this process is worker 0 of the group).

    ``label`` names a worker in errors ("TP rank", "pipeline stage"); ``error`` is the exception
    type raised for a failed or lost worker. ``target(rank, init_method, backend, conn, xconn,
    *args)`` is the worker's main function (importable: ``spawn`` pickles it by name).
    """

    def __init__(
        self,
        world: int,
        label: str,
        error: type[WorkerError],
        target: Callable[..., None],
        args: tuple[Any, ...],
        device: str,
        transfer_pipes: bool = False,
    ) -> None:
        self.label = label
        self.error = error
        self.backend = dist_backend(device)
        if self.backend == "nccl":
            for k, v in NCCL_ENV.items():
                os.environ.setdefault(k, v)  # before spawning: the workers inherit the environment
        self._dir = tempfile.mkdtemp(prefix="pdserve-workers-")
        self.init_method = f"file://{self._dir}/rendezvous"
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._xconns: list[Connection] = []  # transfer pipes (KV writes), one per worker
        self._procs: list[BaseProcess] = []
        self._awaited: list[int] = []  # per worker: replies due on its command pipe, not read yet
        self._closed = False
        try:
            for rank in range(1, world):
                parent, child = ctx.Pipe()
                xparent, xchild = ctx.Pipe() if transfer_pipes else (None, None)
                proc = ctx.Process(
                    target=target,
                    args=(rank, self.init_method, self.backend, child, xchild, *args),
                    name=f"pdserve-{label.split()[-1]}{rank}",
                    daemon=True,
                )
                proc.start()
                child.close()
                self._conns.append(parent)
                self._awaited.append(0)
                if xparent is not None and xchild is not None:
                    xchild.close()
                    self._xconns.append(xparent)
                self._procs.append(proc)
        except BaseException:
            self.close()
            raise

    @property
    def ranks(self) -> range:
        return range(1, len(self._procs) + 1)

    @property
    def world(self) -> int:
        """Workers and this process: the group's size."""
        return len(self._procs) + 1

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def send(self, rank: int, msg: object) -> None:
        try:
            self._conns[rank - 1].send(msg)
        except (BrokenPipeError, OSError) as e:
            raise self.error(f"{self.label} {rank} is gone: {e}") from e

    def broadcast(self, msg: object, replies_from: Sequence[int] = ()) -> None:
        """Send ``msg`` to every worker after ``check()``; returns without waiting. The workers
        in ``replies_from`` will answer it (``recv``); a broadcast to all answering: ``ask_all``."""
        self.check()
        for rank in self.ranks:
            self.send(rank, msg)
        for rank in replies_from:
            self._awaited[rank - 1] += 1

    def ask_all(self, msg: object, timeout_s: float) -> list[Any]:
        """``msg`` to every worker, and their replies in rank order."""
        self.broadcast(msg, replies_from=self.ranks)
        return [self.recv(rank, timeout_s) for rank in self.ranks]

    def recv(self, rank: int, timeout_s: float, conn: Connection | None = None, what: str = "answer") -> Any:
        """The next reply of worker ``rank`` (on its command pipe unless ``conn``); the group's
        error type if it fails, if any worker dies meanwhile, or after ``timeout_s``."""
        conn = conn if conn is not None else self._conns[rank - 1]
        deadline = time.monotonic() + timeout_s
        while not conn.poll(0.05):
            self.check_alive()
            if time.monotonic() > deadline:
                raise self.error(f"{self.label} {rank} did not {what} in {timeout_s:.0f} s")
        reply = self._read(rank, conn)
        if conn is self._conns[rank - 1]:
            self._awaited[rank - 1] -= 1
        return reply

    def request(self, rank: int, msg: object, timeout_s: float, what: str) -> Any:
        """Send ``msg`` on worker ``rank``'s transfer pipe and wait for its reply (the caller
        serialises requests per worker)."""
        conn = self._xconns[rank - 1]
        try:
            conn.send(msg)
        except (BrokenPipeError, OSError) as e:
            raise self.error(f"{self.label} {rank} is gone: {e}") from e
        return self.recv(rank, timeout_s, conn=conn, what=what)

    def _read(self, rank: int, conn: Connection) -> Any:
        """One message of worker ``rank`` from ``conn``; the group's error type for end-of-file
        (the worker is gone) or a failure report."""
        try:
            reply = conn.recv()
        except EOFError:
            raise self.error(f"{self.label} {rank} exited ({self._exit_code(rank)})") from None
        if isinstance(reply, WorkerFailed):
            raise self.error(f"{self.label} {rank} failed ({reply.kind}):\n{reply.traceback}")
        return reply

    def _exit_code(self, rank: int) -> str:
        proc = self._procs[rank - 1]
        proc.join(0.5)
        return f"exit code {proc.exitcode}"

    def check_alive(self) -> None:
        """Raise naming a worker process that is gone (with its failure report, if any)."""
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs, strict=True), start=1):
            if not proc.is_alive():
                detail = ""
                if conn.poll():
                    try:
                        reply = conn.recv()
                        detail = f": {reply.traceback}" if isinstance(reply, WorkerFailed) else ""
                    except (EOFError, OSError):
                        pass  # it died without a report; the exit code says it
                raise self.error(f"{self.label} {rank} exited ({self._exit_code(rank)}){detail}")

    def check(self) -> None:
        """Raise if a worker reported a failure or is gone (a pipe with a reply due is left to
        ``recv``: only the process's liveness is checked there)."""
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs, strict=True), start=1):
            if (
                not self._awaited[rank - 1] and conn.poll()
            ):  # a failure report, or end-of-file when the worker is gone
                reply = self._read(rank, conn)
                raise AssertionError(f"{self.label} {rank} sent an unexpected {reply!r}")
            if not proc.is_alive():
                raise self.error(f"{self.label} {rank} exited ({self._exit_code(rank)})")

    def close(self, timeout_s: float = 10.0) -> None:
        """Shut every worker down (terminated after ``timeout_s``); idempotent."""
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            try:
                conn.send(Shutdown())
            except (BrokenPipeError, OSError):
                pass  # that worker is already gone; joined below
        for rank, proc in enumerate(self._procs, start=1):
            proc.join(timeout_s)
            if proc.is_alive():
                logger.warning("%s %d did not exit in %.0f s; terminating it", self.label, rank, timeout_s)
                proc.terminate()
                proc.join(timeout_s)
        for conn in (*self._conns, *self._xconns):
            conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)
