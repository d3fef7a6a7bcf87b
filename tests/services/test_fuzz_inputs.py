"""Fuzz: malformed gRPC messages -> INVALID_ARGUMENT; malformed tensors -> 400 / INVALID_ARGUMENT.

A colocated node in-process (real gRPC server, real engine); the router app with a fake backend.
After all of it the node still serves and holds no block.
"""

from __future__ import annotations

import asyncio
import base64
import pickle
import random
import socket
from collections.abc import Callable

import grpc
import httpx
import torch
from safetensors.torch import save as save_safetensors

from pdserve.config.engine import EngineConfig
from pdserve.config.node_spec import NodeSpec
from pdserve.engine.sampling_params import SamplingParams
from pdserve.rpc import convert
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from services.decode.server import DecodeNode
from tests.services.test_router_api import (  # noqa: F401  (fixtures)
    HIDDEN,
    FakeBackend,
    ServerThread,
    _cmpl,
    assert_openai_error,
    embeds_b64,
    server_factory,
    tokenizer,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bad_tensors(hidden: int) -> dict[str, pb.Tensor]:
    good = convert.tensor_to_pb(torch.zeros(3, hidden))
    return {
        "nan": convert.tensor_to_pb(torch.full((3, hidden), float("nan"))),
        "wrong_dtype_name": pb.Tensor(dtype="complex64", shape=[3, hidden], data=good.data),
        "int_dtype": pb.Tensor(dtype="int32", shape=[3, hidden], data=good.data),
        "wrong_width": convert.tensor_to_pb(torch.zeros(3, hidden + 1)),
        "3d": convert.tensor_to_pb(torch.zeros(1, 3, hidden)),
        "truncated": pb.Tensor(dtype=good.dtype, shape=list(good.shape), data=good.data[:-5]),
        "pickle_bytes": pb.Tensor(
            dtype="float32", shape=[3, hidden], data=pickle.dumps(torch.zeros(3, hidden))
        ),
        "negative_shape": pb.Tensor(dtype="float32", shape=[-1, hidden], data=b""),
        "oversized_shape": pb.Tensor(dtype="float32", shape=[1 << 40, hidden], data=b"\0" * 16),
    }


def test_malformed_grpc_is_invalid_argument_and_the_node_lives(tiny_models) -> None:
    port = _free_port()
    model = tiny_models["llama"]
    node = DecodeNode(
        NodeSpec.for_test(
            name="fuzz-0", role="colocated", engine=EngineConfig(model=str(model)), grpc_port=port
        )
    )
    hidden = node.engine.runner.arch.hidden_size
    rng = random.Random(13)

    async def main() -> None:
        ready = asyncio.Event()
        serving = asyncio.ensure_future(node.serve(ready))
        await asyncio.wait_for(ready.wait(), 60)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            raw: Callable[[str], Callable[..., object]] = lambda m: ch.unary_unary(  # noqa: E731
                m, request_serializer=lambda b: b, response_deserializer=lambda b: b
            )
            garbage = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) for _ in range(30)]
            garbage += [b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", pickle.dumps({"x": 1})]
            n_invalid = 0
            for g in garbage:
                for method in ("/pdserve.rpc.DecodeService/GetLoad", "/pdserve.rpc.DecodeService/Abort"):
                    try:
                        await raw(method)(g, timeout=5)
                    except grpc.aio.AioRpcError as e:
                        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (g, e.code(), e.details())
                        n_invalid += 1
                stream = ch.unary_stream(
                    "/pdserve.rpc.DecodeService/Decode",
                    request_serializer=lambda b: b,
                    response_deserializer=lambda b: b,
                )
                try:
                    async for _ in stream(g, timeout=5):
                        pass
                except grpc.aio.AioRpcError as e:
                    # Bytes that happen to parse reach the servicer's own checks (also 4xx-like).
                    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (g, e.code(), e.details())
            assert n_invalid > 20  # most random bytes do not parse
            stub = pb_grpc.DecodeServiceStub(ch)
            sampling = convert.sampling_to_pb(SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            for name, t in _bad_tensors(hidden).items():
                req = pb.DecodeRequest(
                    request_id=f"bad-{name}", prompt_token_ids=[0, 0, 0], sampling=sampling
                )
                req.prompt_embeds.CopyFrom(t)
                try:
                    async for _ in stub.Decode(req, timeout=10):
                        pass
                    raise AssertionError(f"{name}: accepted")
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e.code(), e.details())
            ok = pb.DecodeRequest(request_id="after", prompt_token_ids=[1, 2, 3], sampling=sampling)
            msgs = [m async for m in stub.Decode(ok, timeout=30)]
            assert msgs[-1].finish_reason == "length"
            rep = await stub.GetLoad(pb.LoadRequest(), timeout=5)
            assert rep.num_blocks_used == 0 and rep.num_running == 0
        node.request_stop()
        await asyncio.wait_for(serving, 15)
        assert node.exit_code == 0

    asyncio.run(main())


def test_malformed_tensors_over_http_are_400(server_factory: Callable[..., ServerThread]) -> None:  # noqa: F811
    backend = FakeBackend()
    srv = server_factory(backend)
    good = base64.b64decode(embeds_b64(torch.zeros(4, HIDDEN)))
    rng = random.Random(7)
    cases = {
        "truncated": base64.b64encode(good[: len(good) // 2]).decode(),
        "header_only": base64.b64encode(good[:8]).decode(),
        "huge_header_len": base64.b64encode((1 << 60).to_bytes(8, "little") + good[8:]).decode(),
        "pickle": base64.b64encode(pickle.dumps(torch.zeros(4, HIDDEN))).decode(),
        "oversized": embeds_b64(torch.zeros(4096, HIDDEN)),  # more rows than the context
        "bf16_nan": embeds_b64(torch.full((2, HIDDEN), float("nan"), dtype=torch.bfloat16)),
        "f32_nan_one": embeds_b64(torch.zeros(3, HIDDEN).index_fill_(1, torch.tensor([5]), float("nan"))),
        "f16_neg_inf": embeds_b64(torch.full((2, HIDDEN), float("-inf"), dtype=torch.float16)),
        "int8": embeds_b64(torch.zeros(2, HIDDEN, dtype=torch.int8)),
        "bool": embeds_b64(torch.zeros(2, HIDDEN, dtype=torch.bool)),
        "1d": embeds_b64(torch.zeros(HIDDEN)),
        "wrong_width": embeds_b64(torch.zeros(2, HIDDEN - 1)),
        "no_rows": embeds_b64(torch.zeros(0, HIDDEN)),
        "two_tensors": base64.b64encode(
            save_safetensors({"a": torch.zeros(2, HIDDEN), "b": torch.zeros(2, HIDDEN)})
        ).decode(),
        "truncated_by_one": base64.b64encode(good[:-1]).decode(),
    }
    for i in range(20):
        cases[f"random{i}"] = base64.b64encode(
            bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        ).decode()
    for name, b64 in cases.items():
        resp = httpx.post(srv.url + "/v1/completions", json=_cmpl(prompt="", prompt_embeds=b64), timeout=10)
        assert resp.status_code == 400, (name, resp.status_code, resp.text[:200])
        assert_openai_error(resp, 400)
    assert not backend.requests
