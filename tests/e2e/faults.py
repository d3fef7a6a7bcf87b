"""Fault injection at a phase of the request lifecycle, for the chaos tests and bench/chaos.py.

``PhasedBackend`` is the router's real ``PDBackend`` (same lifecycle code) with one hook: a
callback runs when a request reaches a phase, and may kill, freeze, restart a node process or
drop a transfer there. Nodes are real processes (``tests/e2e/cluster.py``).

    phases: before_prefill | after_prefill (KV held, before decode admits) | during_decode
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
from services.router.pd_backend import NodeHandle, PDBackend

Hook = Callable[[str, dict[str, Any]], Awaitable[None]]
PHASES = ("before_prefill", "after_prefill", "during_decode")


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

    async def _prefill_leg(
        self, p: NodeHandle, req: BackendRequest, transfer_id: str, d_pp: int = 1
    ) -> GenerationDelta:
        await self._fire("before_prefill", req.request_id, node=p.name, transfer_id=transfer_id)
        first = await super()._prefill_leg(p, req, transfer_id, d_pp)
        await self._fire("after_prefill", req.request_id, node=p.name, transfer_id=transfer_id)
        return first

    async def _decode_leg(
        self, d_node: NodeHandle, req: BackendRequest, *args: Any
    ) -> AsyncGenerator[GenerationDelta, None]:
        n = 0
        async for d in super()._decode_leg(d_node, req, *args):
            n += 1
            yield d
            if n == self.decode_hook_after and d.finish_reason is None:
                await self._fire("during_decode", req.request_id, node=d_node.name)


def signal_node(rc: Any, name: str, sig: signal.Signals) -> None:
    child = next(c for c in rc.children if c.name == name)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.proc.pid, sig)
    if sig == signal.SIGKILL:
        child.proc.wait(timeout=10)


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
