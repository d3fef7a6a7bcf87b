"""A node is healthy only while its engine thread is (docs/design.md §7): in-process node, real gRPC."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.config.engine import EngineConfig
from pdserve.config.node_spec import NodeSpec
from pdserve.engine.sampling_params import SamplingParams
from pdserve.rpc import convert
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from services.decode.server import DecodeNode
from services.node import EXIT_ENGINE_DIED


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _colocated_node(tiny_models, port: int, **opts) -> DecodeNode:  # type: ignore[no-untyped-def]
    engine = EngineConfig(model=str(tiny_models["llama"]))
    return DecodeNode(
        NodeSpec.for_test(name="colo-0", role="colocated", engine=engine, grpc_port=port, **opts)
    )


def test_engine_death_turns_node_not_serving_fails_requests_and_exits(tiny_models) -> None:
    port = _free_port()
    node = _colocated_node(tiny_models, port)

    async def main() -> None:
        ready = asyncio.Event()
        serving = asyncio.ensure_future(node.serve(ready))
        await asyncio.wait_for(ready.wait(), 60)
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(ch)
        stub = pb_grpc.DecodeServiceStub(ch)
        ok = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert ok.status == health_pb2.HealthCheckResponse.SERVING

        def broken(*_a: object) -> list:  # type: ignore[type-arg]
            raise RuntimeError("simulated device loss")

        node.engine.step = broken  # type: ignore[method-assign]
        node.engine.fail_all = broken  # type: ignore[method-assign]
        req = pb.DecodeRequest(
            request_id="victim",
            prompt_token_ids=[1, 2, 3, 4],
            sampling=convert.sampling_to_pb(SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
        )
        t0 = asyncio.get_running_loop().time()
        msgs = [m async for m in stub.Decode(req, timeout=10)]
        assert msgs[-1].finish_reason == "error" and "engine thread" in msgs[-1].error
        assert asyncio.get_running_loop().time() - t0 < 5, "in-flight request was not failed at once"
        bad = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert bad.status == health_pb2.HealthCheckResponse.NOT_SERVING
        try:
            await stub.GetLoad(pb.LoadRequest(), timeout=5)
            raise AssertionError("GetLoad answered for a dead engine")
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
        try:
            async for _ in stub.Decode(
                pb.DecodeRequest(request_id="late", prompt_token_ids=[1], sampling=req.sampling), timeout=5
            ):
                pass
            raise AssertionError("a new request was admitted by a dead engine")
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
        await ch.close()
        await asyncio.wait_for(serving, 15)  # serve() returns by itself
        assert node.exit_code == EXIT_ENGINE_DIED

    asyncio.run(main())


def test_prefill_engine_death_is_unavailable_for_the_router_to_retry(tiny_models) -> None:
    from services.prefill.server import PrefillNode

    port = _free_port()
    node = PrefillNode(
        NodeSpec.for_test(
            name="p-0", role="prefill", engine=EngineConfig(model=str(tiny_models["llama"])), grpc_port=port
        )
    )

    async def main() -> None:
        ready = asyncio.Event()
        serving = asyncio.ensure_future(node.serve(ready))
        await asyncio.wait_for(ready.wait(), 60)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.PrefillServiceStub(ch)

            def broken(*_a: object) -> list:  # type: ignore[type-arg]
                raise RuntimeError("simulated device loss")

            node.engine.step = broken  # type: ignore[method-assign]
            node.engine.fail_all = broken  # type: ignore[method-assign]
            sampling = convert.sampling_to_pb(SamplingParams(temperature=0.0, max_tokens=8))
            try:
                await stub.Prefill(
                    pb.PrefillRequest(
                        transfer_id="t1", prompt_token_ids=list(range(1, 40)), sampling=sampling
                    ),
                    timeout=10,
                )
                raise AssertionError("a prefill on a dead engine answered")
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE and "engine thread" in (e.details() or "")
            assert node.producer.tracker.num_held_blocks == 0
        await asyncio.wait_for(serving, 15)
        assert node.exit_code == EXIT_ENGINE_DIED

    asyncio.run(main())


def test_readiness_waits_for_the_steps_socket_and_liveness_does_not(tiny_models, monkeypatch) -> None:
    """While the Steps socket is starting, the node's gRPC server already answers: liveness
    SERVING, readiness NOT_SERVING, GetLoad UNAVAILABLE (a router polling then would take the
    node before it can open its token stream); once the socket listens, readiness turns SERVING
    and GetLoad names its address (a ready node never reports an empty steps_socket)."""
    from services.node import NodeBase
    from services.node_lifecycle import LIVENESS_SERVICE

    port = _free_port()
    node = _colocated_node(tiny_models, port)  # frontend_port None: the Steps socket on any free port
    gate = asyncio.Event()
    start = NodeBase._start_frontend

    async def slow_start(self):  # type: ignore[no-untyped-def]
        await gate.wait()
        return await start(self)

    monkeypatch.setattr(NodeBase, "_start_frontend", slow_start)

    async def main() -> None:
        ready = asyncio.Event()
        serving = asyncio.ensure_future(node.serve(ready))
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(ch)

        async def status(service: str) -> int:
            while True:
                try:
                    r = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                    return int(r.status)
                except grpc.aio.AioRpcError:  # the server is not up yet
                    await asyncio.sleep(0.05)

        assert await asyncio.wait_for(status(LIVENESS_SERVICE), 60) == health_pb2.HealthCheckResponse.SERVING
        assert await status("") == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as starting:
            await pb_grpc.DecodeServiceStub(ch).GetLoad(pb.LoadRequest(), timeout=5)
        assert starting.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "is starting" in (starting.value.details() or "")
        assert not ready.is_set()
        gate.set()
        await asyncio.wait_for(ready.wait(), 60)
        assert await status("") == health_pb2.HealthCheckResponse.SERVING
        rep = await pb_grpc.DecodeServiceStub(ch).GetLoad(pb.LoadRequest(), timeout=5)
        assert rep.steps_socket.startswith("127.0.0.1:"), rep.steps_socket
        await ch.close()
        node.request_stop()
        await asyncio.wait_for(serving, 30)

    asyncio.run(main())
