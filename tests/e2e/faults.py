"""Fault injection at a phase of the request lifecycle, for the chaos tests and bench/chaos.py.

``PhasedBackend`` is the router's real ``PDBackend`` (same lifecycle code) with one hook: a
callback runs when a request reaches a phase, and may kill, freeze, restart a node process or
drop a transfer there. Nodes are real processes (``tests/e2e/cluster.py``).

    phases: before_prefill | after_prefill (KV held, before decode admits)
            | during_transfer (prefill reports a PushKV in flight for the request's decode leg;
              the nodes' test-only ``faults.push_delay_s`` makes that window long enough)
            | during_decode
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from pdserve.engine.outputs import GenerationDelta
from services.router.backend import BackendRequest
from services.router.nodes import NodeHandle
from services.router.pd_backend import PDBackend

Hook = Callable[[str, dict[str, Any]], Awaitable[None]]
PHASES = ("before_prefill", "after_prefill", "during_transfer", "during_decode")
TRANSFER_POLL_S = 0.02


class PhasedBackend(PDBackend):
    def __init__(self, *args: Any, hook: Hook | None = None, decode_hook_after: int = 3, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.hook = hook
        self.decode_hook_after = decode_hook_after  # deltas from decode before during_decode fires
        self._fired: set[tuple[str, str]] = set()

    async def _fire(self, phase: str, req_id: str, **info: Any) -> None:
        if self.hook is not None and (phase, req_id) not in self._fired:
            self._fired.add((phase, req_id))
            await self.hook(phase, {"request_id": req_id, **info})

    async def prefill_leg(
        self, p: NodeHandle, req: BackendRequest, transfer_id: str, d_pp: int = 1, d_tp: int = 1
    ) -> GenerationDelta:
        await self._fire("before_prefill", req.request_id, node=p.name, transfer_id=transfer_id)
        first = await super().prefill_leg(p, req, transfer_id, d_pp, d_tp)
        await self._fire("after_prefill", req.request_id, node=p.name, transfer_id=transfer_id)
        return first

    async def decode_leg(
        self, d_node: NodeHandle, req: BackendRequest, *args: Any
    ) -> AsyncGenerator[GenerationDelta, None]:
        transfer_id, p_node = args[0], args[1]
        watch = None
        if transfer_id is not None and p_node is not None and self.hook is not None:
            watch = asyncio.ensure_future(self._watch_transfer(p_node, req.request_id, transfer_id))
        n = 0
        try:
            async for d in super().decode_leg(d_node, req, *args):
                n += 1
                yield d
                if n == self.decode_hook_after and d.finish_reason is None:
                    await self._fire("during_decode", req.request_id, node=d_node.name)
        finally:
            if watch is not None and not watch.done():
                watch.cancel()

    async def _watch_transfer(self, p: NodeHandle, req_id: str, transfer_id: str) -> None:
        """Fire during_transfer once prefill ``p`` serves a PushKV (decode's pull is in flight)."""
        import grpc

        from pdserve.rpc import node_pb2 as pb
        from pdserve.rpc import node_pb2_grpc as pb_grpc

        stub = pb_grpc.PrefillServiceStub(p.channel)
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                if (await stub.GetLoad(pb.LoadRequest(), timeout=1.0)).num_pushes_in_flight > 0:
                    await self._fire("during_transfer", req_id, node=p.name, transfer_id=transfer_id)
                    return
            await asyncio.sleep(TRANSFER_POLL_S)


def signal_node(rc: Any, name: str, sig: signal.Signals) -> None:
    child = next(c for c in rc.children if c.name == name)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.proc.pid, sig)
    if sig == signal.SIGKILL:
        child.proc.wait(timeout=10)


def kill_engine(rc: Any, name: str) -> None:
    """Kill the engine thread of a node started with ``faults.engine_death_on_sigusr1`` (SIGUSR1 to
    the node process itself, not its group). The node then exits by itself (70): see exit_code."""
    child = next(c for c in rc.children if c.name == name)
    with contextlib.suppress(ProcessLookupError):
        os.kill(child.proc.pid, signal.SIGUSR1)


def exit_code(rc: Any, name: str, wait_s: float = 15.0) -> int | None:
    """The node process's exit code once it ended (None: still running after ``wait_s``)."""
    import subprocess

    child = next(c for c in rc.children if c.name == name)
    try:
        return child.proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return None


async def freeze_for(rc: Any, name: str, seconds: float) -> None:
    """SIGSTOP a node now and SIGCONT it ``seconds`` later (in the background)."""
    signal_node(rc, name, signal.SIGSTOP)

    async def thaw() -> None:
        await asyncio.sleep(seconds)
        signal_node(rc, name, signal.SIGCONT)

    rc.__dict__.setdefault("_thaw_tasks", set()).add(asyncio.get_running_loop().create_task(thaw()))


def backend_for(rc: Any, hook: Hook | None = None, **policy: Any) -> PhasedBackend:
    from services.router.pd_backend import RouterPolicy

    c = rc.cluster
    return PhasedBackend(
        [(n.name, n.grpc_address) for n in c.prefill_nodes],
        [(n.name, n.grpc_address) for n in c.decode_nodes],
        RouterPolicy(**{"local_prefill_max_tokens": 0, **policy}),
        hook=hook,
    )
