"""PDFlow's transitions (services/router/pd_flow.py), against a fake leg client.

The fake stands in for PDBackend's gRPC and Steps-stream calls inside this unit test only: each
prefill node answers from a script (a first token, or a gRPC status), each decode leg either
streams to its finish or fails its KV pull. The real legs are covered by tests/e2e.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import grpc
import pytest

from pdserve.engine.outputs import GenerationDelta
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import CapacityError, InvalidRequestError
from services.router.backend import BackendRequest
from services.router.nodes import NodeHandle, RouterPolicy
from services.router.pd_flow import KVLoadFailedError, PDFlow, Phase


def _node(name: str, role: str) -> NodeHandle:
    return NodeHandle(name, role, f"{name}:1", channel=None, healthy=True)  # type: ignore[arg-type]


def _rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)


class FakeLegs:
    """``prefill_script[node]``: what each of its Prefill calls does, in order ("ok", "eos" or a
    StatusCode); ``decode_script``: one entry per decode leg ("ok" or "kv_fail")."""

    def __init__(self, n_prefill: int, leg: str = "after_prefill", **scripts: Any) -> None:
        self.prefill = [_node(f"p{i}", "prefill") for i in range(n_prefill)]
        self.policy = RouterPolicy(pd_decode_leg=leg)
        self.prefill_script: dict[str, list[Any]] = scripts.get("prefill_script", {})
        self.decode_script: list[str] = scripts.get("decode_script", ["ok"])
        self.paths: list[str] = []
        self.failures: list[tuple[str, str]] = []
        self.calls: list[tuple[Any, ...]] = []
        self.gate: asyncio.Event | None = None  # a decode leg waits on it before its last delta

    def pick(self, nodes: list[NodeHandle], key: bytes | None, exclude: Any = frozenset()) -> NodeHandle:
        live = [n for n in nodes if n.name not in exclude]
        if not live:
            raise CapacityError("no node")
        return live[0]

    def count_path(self, path: str) -> None:
        self.paths.append(path)

    def count_leg_failure(self, role: str, code: str) -> None:
        self.failures.append((role, code))

    async def prefill_leg(
        self, p: NodeHandle, req: BackendRequest, transfer_id: str, d_pp: int, d_tp: int = 1
    ) -> GenerationDelta:
        self.calls.append(("prefill", p.name, transfer_id))
        what = self.prefill_script.get(p.name, ["ok"]).pop(0)
        if isinstance(what, grpc.StatusCode):
            raise _rpc_error(what)
        p.epoch_by_transfer[transfer_id] = "e1"
        return GenerationDelta(req.request_id, [7], "", finish_reason="stop" if what == "eos" else None)

    async def decode_leg(
        self,
        d: NodeHandle,
        req: BackendRequest,
        transfer_id: str | None,
        p: NodeHandle | None,
        first_tokens: list[int],
        early: Any = None,
    ) -> AsyncGenerator[GenerationDelta, None]:
        self.calls.append(("decode", p.name if p else None, transfer_id, list(first_tokens), early))
        if self.decode_script.pop(0) == "kv_fail":
            raise KVLoadFailedError("pull failed")
        yield GenerationDelta(req.request_id, [8], "")
        if self.gate is not None:
            await self.gate.wait()
        yield GenerationDelta(req.request_id, [9], "", finish_reason="length")

    def open_early_leg(self, d: NodeHandle, req: BackendRequest, transfer_id: str, p: NodeHandle) -> Any:
        self.calls.append(("open_early", p.name, transfer_id))
        return ("early", transfer_id)

    async def drop_early_leg(self, d: NodeHandle, early: Any) -> None:
        self.calls.append(("drop_early", early))

    async def abort_prefill(self, p: NodeHandle, transfer_id: str) -> None:
        self.calls.append(("abort_prefill", p.name, transfer_id))


def _req(**kw: Any) -> BackendRequest:
    return BackendRequest("r0", [1, 2, 3], SamplingParams(max_tokens=3), **kw)


def _run(
    legs: FakeLegs, local: bool = False, req: BackendRequest | None = None
) -> tuple[PDFlow, list[int], int]:
    done = []
    flow = PDFlow(
        legs, req or _req(), _node("d0", "decode"), None, local=local, on_done=lambda: done.append(1)
    )

    async def collect() -> list[int]:
        return [t for d in [d async for d in flow.run()] for t in d.token_ids]

    tokens = asyncio.run(collect())
    return flow, tokens, len(done)


def _kinds(legs: FakeLegs) -> list[str]:
    return [c[0] for c in legs.calls]


def test_local_path_decodes_on_the_decode_node_and_remembers_the_blocks() -> None:
    legs = FakeLegs(1)
    flow, tokens, remembered = _run(legs, local=True)
    assert flow.history == [Phase.LOCAL, Phase.DONE]
    assert tokens == [8, 9] and remembered == 1 and legs.paths == ["local"]
    assert legs.calls == [("decode", None, None, [], None)]


def test_serial_legs_prefill_then_decode_with_the_first_token() -> None:
    legs = FakeLegs(1)
    flow, tokens, remembered = _run(legs)
    assert flow.history == [Phase.PREFILL, Phase.DECODE, Phase.DONE]
    assert tokens == [7, 8, 9] and remembered == 1 and legs.paths == ["disaggregated"]
    tid = legs.calls[0][2]
    assert legs.calls[1] == ("decode", "p0", tid, [7], None)
    assert legs.prefill[0].epoch_by_transfer == {}  # the Prefill answer's epoch does not outlive the flow


def test_early_leg_is_opened_before_prefill_and_read_by_the_decode_state() -> None:
    legs = FakeLegs(1, leg="with_prefill")
    flow, tokens, _ = _run(legs)
    assert flow.history == [Phase.PREFILL_EARLY, Phase.DECODE_EARLY, Phase.DONE]
    tid = legs.calls[0][2]
    assert _kinds(legs) == ["open_early", "prefill", "decode"]
    assert legs.calls[2][-1] == ("early", tid) and tokens == [7, 8, 9]


def test_images_never_take_the_early_leg() -> None:
    legs = FakeLegs(1, leg="with_prefill")
    flow, _, _ = _run(legs, req=_req(mm_items=[object()]))
    assert flow.history[0] is Phase.PREFILL and "open_early" not in _kinds(legs)


def test_a_failed_early_prefill_drops_the_early_leg_and_goes_serial_on_the_next_node() -> None:
    legs = FakeLegs(2, leg="with_prefill", prefill_script={"p0": [grpc.StatusCode.UNAVAILABLE]})
    flow, tokens, _ = _run(legs)
    assert flow.history == [Phase.PREFILL_EARLY, Phase.PREFILL, Phase.DECODE, Phase.DONE]
    assert _kinds(legs) == ["open_early", "prefill", "drop_early", "prefill", "decode"]
    assert legs.calls[-1][1] == "p1" and legs.calls[-1][-1] is None  # a fresh, serial decode leg
    assert not legs.prefill[0].healthy and legs.failures == [("prefill", "UNAVAILABLE")]
    assert tokens == [7, 8, 9]


def test_every_prefill_node_failing_falls_back_to_local_without_remembering() -> None:
    legs = FakeLegs(2, prefill_script={"p0": [grpc.StatusCode.INTERNAL], "p1": [grpc.StatusCode.INTERNAL]})
    flow, tokens, remembered = _run(legs)
    assert flow.history == [Phase.PREFILL, Phase.PREFILL, Phase.LOCAL, Phase.DONE]
    assert legs.paths == ["disaggregated", "local_fallback"] and remembered == 0 and tokens == [8, 9]
    assert legs.prefill[0].healthy  # INTERNAL is a failed leg, not a node that is gone


@pytest.mark.parametrize(
    ("code", "mm", "error"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, False, InvalidRequestError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, False, CapacityError),
        (grpc.StatusCode.FAILED_PRECONDITION, True, CapacityError),  # an image's embedding is gone
        (grpc.StatusCode.UNAVAILABLE, True, CapacityError),  # images: no local fallback
    ],
)
def test_prefill_failures_the_client_sees(code: grpc.StatusCode, mm: bool, error: type[Exception]) -> None:
    legs = FakeLegs(1, leg="with_prefill", prefill_script={"p0": [code]})
    with pytest.raises(error):
        _run(legs, req=_req(mm_items=[object()] if mm else []))
    assert "decode" not in _kinds(legs)


def test_an_early_leg_is_dropped_when_the_prefill_leg_is_refused() -> None:
    legs = FakeLegs(1, leg="with_prefill", prefill_script={"p0": [grpc.StatusCode.INVALID_ARGUMENT]})
    with pytest.raises(InvalidRequestError):
        _run(legs)
    assert _kinds(legs) == ["open_early", "prefill", "drop_early"]


def test_a_first_token_that_finishes_ends_the_flow_and_frees_both_legs() -> None:
    legs = FakeLegs(1, leg="with_prefill", prefill_script={"p0": ["eos"]})
    flow, tokens, remembered = _run(legs)
    assert flow.history == [Phase.PREFILL_EARLY, Phase.DONE]
    assert _kinds(legs) == ["open_early", "prefill", "drop_early", "abort_prefill"]
    assert tokens == [7] and remembered == 0


def test_a_failed_pull_is_reprefilled_on_another_node() -> None:
    legs = FakeLegs(2, leg="with_prefill", decode_script=["kv_fail", "ok"])
    flow, tokens, remembered = _run(legs)
    assert flow.history == [
        Phase.PREFILL_EARLY,
        Phase.DECODE_EARLY,
        Phase.REPREFILL,
        Phase.DECODE,
        Phase.DONE,
    ]
    reprefill_tid = legs.calls[3][2]
    assert legs.calls[3][:2] == ("prefill", "p1")
    # the client already has the first token: decode gets it with the new transfer
    assert legs.calls[4] == ("decode", "p1", reprefill_tid, [7], None)
    assert legs.paths == ["disaggregated", "reprefill"] and tokens == [7, 8, 9] and remembered == 1


def test_a_failed_pull_with_no_other_prefill_node_is_recomputed_on_decode() -> None:
    legs = FakeLegs(1, decode_script=["kv_fail", "ok"])
    flow, tokens, _ = _run(legs)
    assert flow.history == [Phase.PREFILL, Phase.DECODE, Phase.REPREFILL, Phase.DECODE, Phase.DONE]
    assert legs.calls[-1] == ("decode", None, None, [7], None)
    assert legs.paths == ["disaggregated", "reprefill_local"] and tokens == [7, 8, 9]


def test_a_failed_reprefill_leg_moves_on_and_images_without_tensors_cannot_be_recomputed() -> None:
    legs = FakeLegs(2, decode_script=["kv_fail"], prefill_script={"p1": [grpc.StatusCode.UNAVAILABLE]})
    with pytest.raises(CapacityError, match="fetch the images"):
        _run(legs, req=_req(mm_items=[type("Item", (), {"embeds": None})()]))
    assert legs.failures == [("prefill", "UNAVAILABLE")]


def test_a_client_leaving_at_the_first_token_drops_the_early_leg_and_the_epochs() -> None:
    legs = FakeLegs(1, leg="with_prefill")
    flow = PDFlow(legs, _req(), _node("d0", "decode"), None, local=False, on_done=lambda: None)

    async def leave_after_first() -> None:
        gen = flow.run()
        assert (await gen.__anext__()).token_ids == [7]
        await gen.aclose()

    asyncio.run(leave_after_first())
    assert _kinds(legs) == ["open_early", "prefill", "drop_early"]
    assert legs.prefill[0].epoch_by_transfer == {} and flow.early is None


def test_a_client_leaving_mid_decode_leaves_the_early_leg_to_the_decode_leg() -> None:
    legs = FakeLegs(1, leg="with_prefill")
    legs.gate = asyncio.Event()  # never set: the decode leg waits after its first delta
    flow = PDFlow(legs, _req(), _node("d0", "decode"), None, local=False, on_done=lambda: None)

    async def leave_mid_decode() -> None:
        gen = flow.run()
        assert [(await gen.__anext__()).token_ids for _ in range(2)] == [[7], [8]]
        await gen.aclose()

    asyncio.run(leave_mid_decode())
    assert "drop_early" not in _kinds(legs)  # the decode leg owns (and aborts) it from DECODE_EARLY
    assert flow.phase is Phase.DECODE_EARLY
