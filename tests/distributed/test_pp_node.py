"""A colocated node with pp=2 or tp=2: killing one worker process takes the whole node out of service."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.config.engine import EngineConfig, ParallelConfig
from pdserve.config.node_spec import NodeSpec
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import PdserveError
from services.decode.server import DecodeNode


@pytest.fixture(scope="module")
def llama4(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=4)


@pytest.mark.parametrize("parallel", [{"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}])
def test_killing_a_stage_fails_requests_and_health(llama4, parallel):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = EngineConfig(model=str(llama4), device="cpu", dtype="float32", parallel=ParallelConfig(**parallel))
    node = DecodeNode(NodeSpec.for_test(name="c0", role="colocated", engine=cfg, grpc_port=port))

    async def scenario() -> tuple[str, int]:
        ready = asyncio.Event()
        serving = asyncio.create_task(node.serve(ready))
        await ready.wait()
        assert node.engine_loop is not None
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        gen = node.engine_loop.generate(list(range(1, 40)), params, "r0")
        first = await gen.__anext__()  # running
        assert first.request_id == "r0"
        os.kill(node.engine.runner.workers.pids()[0], signal.SIGKILL)
        error = ""
        try:
            async for d in gen:
                if d.finish_reason == "error":
                    error = d.error or ""
        except PdserveError as e:
            error = str(e)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            status = health_pb2.HealthCheckResponse.SERVING
            for _ in range(40):  # the watchdog checks every 0.5 s
                try:
                    status = (await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)).status
                except grpc.aio.AioRpcError:
                    status = -1  # already shut down: out of service as well
                if status != health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.1)
        await asyncio.wait_for(serving, 30)
        return error, status

    error, status = asyncio.run(scenario())
    assert "stage 1" in error or "TP rank 1" in error or "engine step failed" in error, error
    assert status in (health_pb2.HealthCheckResponse.NOT_SERVING, -1)
    assert node.exit_code == 1
    node.engine.kv.process_deferred_frees()
    assert node.engine.kv.pool.num_used_blocks == 0
    node.engine.close()


@pytest.mark.parametrize(
    ("role", "opts", "match"),
    [
        ("decode", {"kv_checksum": True}, "kv_checksum with pp=2, tp=1 on a decode node"),
        (
            "prefill",
            {"kv_transport": "cuda_ipc"},
            "kv_transport 'cuda_ipc' with pp=2, tp=1 on a prefill node",
        ),
    ],
)
def test_pp_transfer_settings_not_wired_are_refused_at_start(llama4, role, opts, match) -> None:
    from pdserve.errors import ConfigError
    from services.prefill.server import PrefillNode

    cfg = EngineConfig(
        model=str(llama4), device="cpu", dtype="float32", parallel=ParallelConfig(pipeline_parallel_size=2)
    )
    cls = PrefillNode if role == "prefill" else DecodeNode
    with pytest.raises(ConfigError, match=match):
        cls(NodeSpec.for_test(name="n0", role=role, engine=cfg, **opts))


@pytest.mark.parametrize(
    ("role", "opts", "match"),
    [
        ("prefill", {"kv_checksum": True}, "kv_checksum with pp=1, tp=2 on a prefill node"),
        ("decode", {"kv_transport": "cuda_ipc"}, "kv_transport 'cuda_ipc' with pp=1, tp=2 on a decode node"),
    ],
)
def test_tp_transfer_settings_not_wired_are_refused_at_start(llama4, role, opts, match) -> None:
    """TP with KV transfer runs (tests/e2e/test_tp_pd_e2e.py); what is not wired per rank is refused."""
    from pdserve.errors import ConfigError
    from services.prefill.server import PrefillNode

    cfg = EngineConfig(
        model=str(llama4), device="cpu", dtype="float32", parallel=ParallelConfig(tensor_parallel_size=2)
    )
    cls = PrefillNode if role == "prefill" else DecodeNode
    with pytest.raises(ConfigError, match=match):
        cls(NodeSpec.for_test(name="n0", role=role, engine=cfg, **opts))
