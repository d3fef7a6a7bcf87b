"""Request lifecycle under failure with real router, prefill and decode processes.

The lease is long (60 s) on purpose: every release asserted here must come from an abort, not
from a lease running out.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc
import httpx
import openai
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.rpc import convert
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from tests.e2e.lifecycle_helpers import health_status, wait_nothing_held

pytestmark = pytest.mark.slow
NODES = ["prefill-0", "decode-0"]


@pytest.fixture(scope="module")
def cluster(shared_pd_cluster):
    return shared_pd_cluster  # tests/e2e/conftest.py: local_prefill_max_tokens 16, KV lease 60 s


def _long_stream_body(rc, words: int = 120) -> dict:
    return {
        "model": rc.model_name,
        "prompt": "the clients hang up early " * (words // 5),
        "max_tokens": 64,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }


async def _hang_up_after(url: str, body: dict, delay_s: float) -> None:
    async with httpx.AsyncClient(timeout=30) as h:
        try:
            async with asyncio.timeout(delay_s):
                async with h.stream("POST", url, json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
        except TimeoutError:
            pass


def test_clients_hanging_up_at_once_kill_no_engine(cluster) -> None:
    """The defect: clients closing ~10 ms after a long streaming prompt killed the engine thread."""
    url = cluster.base_url + "/completions"
    before = sum(cluster.load(n).num_aborted_total for n in NODES)

    async def storm() -> None:
        for delay in (0.01, 0.03, 0.1, 0.3):
            await asyncio.gather(*(_hang_up_after(url, _long_stream_body(cluster), delay) for _ in range(12)))

    asyncio.run(storm())
    # Every hold released by the aborts (the lease is 60 s), engines alive, nodes serving.
    wait_nothing_held(cluster, NODES, timeout_s=10)
    # the nodes saw the disconnects: prefill (a prompt or a hold aborted) or, with the decode leg
    # opened with the prefill leg (router.pd_decode_leg with_prefill), decode (its leg aborted
    # after an early pull took the hold)
    assert sum(cluster.load(n).num_aborted_total for n in NODES) > before
    for name in NODES:
        assert health_status(cluster.node(name).grpc_address) == "SERVING"
    c = openai.OpenAI(base_url=cluster.base_url, api_key="x", max_retries=0, timeout=60)
    out = c.completions.create(
        model=cluster.model_name, prompt="still alive " * 10, max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert httpx.get(cluster.cluster.router_url + "/ready").status_code == 200
    wait_nothing_held(cluster, NODES)


def test_disconnect_during_prefill_releases_the_hold_at_once(cluster) -> None:
    """The router's cancel of a prefill leg (call cancelled, then Abort(transfer_id), as
    pd_prefill_leg does) releases prefill's blocks at once, whichever phase the cancel hits."""
    p = cluster.node("prefill-0")
    sampling = convert.sampling_to_pb(SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    before = cluster.load("prefill-0").num_aborted_total

    async def main() -> None:
        async with grpc.aio.insecure_channel(p.grpc_address) as ch:
            stub = pb_grpc.PrefillServiceStub(ch)
            for delay in (0.0, 0.002, 0.005, 0.01, 0.05):
                tids = [uuid.uuid4().hex for _ in range(6)]
                calls = [
                    stub.Prefill(
                        pb.PrefillRequest(
                            transfer_id=t, prompt_token_ids=list(range(1, 200)), sampling=sampling
                        ),
                        timeout=30,
                    )
                    for t in tids
                ]
                await asyncio.sleep(delay)
                for c in calls:
                    c.cancel()
                await stub.Abort(pb.AbortRequest(transfer_ids=tids), timeout=5)

    asyncio.run(main())
    wait_nothing_held(cluster, NODES, timeout_s=2)  # not at the lease's end (60 s)
    assert cluster.load("prefill-0").num_aborted_total > before


def test_second_prefill_with_a_held_transfer_id_is_refused(cluster) -> None:
    p = cluster.node("prefill-0")
    sampling = convert.sampling_to_pb(SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    tid, other_tid = uuid.uuid4().hex, uuid.uuid4().hex

    async def main() -> None:
        async with grpc.aio.insecure_channel(p.grpc_address) as ch:
            stub = pb_grpc.PrefillServiceStub(ch)
            first = await stub.Prefill(
                pb.PrefillRequest(transfer_id=tid, prompt_token_ids=list(range(1, 60)), sampling=sampling),
                timeout=30,
            )
            assert first.kv_held
            other = stub.Prefill(
                pb.PrefillRequest(
                    transfer_id=other_tid, prompt_token_ids=list(range(5, 90)), sampling=sampling
                ),
                timeout=30,
            )
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Prefill(
                    pb.PrefillRequest(
                        transfer_id=tid, prompt_token_ids=list(range(1, 60)), sampling=sampling
                    ),
                    timeout=30,
                )
            assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and tid in (e.value.details() or "")
            ok = await other  # the node's other requests are untouched
            assert ok.kv_held and ok.first.token_ids
            # Nobody pulls these two: the router would abort them, so do we.
            await stub.Abort(pb.AbortRequest(transfer_ids=[tid, other_tid]), timeout=5)

    asyncio.run(main())
    wait_nothing_held(cluster, NODES)
    for name in NODES:
        assert health_status(cluster.node(name).grpc_address) == "SERVING"


def test_huge_batch_is_a_400_and_decode_keeps_serving(cluster) -> None:
    c = openai.OpenAI(base_url=cluster.base_url, api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=cluster.model_name, prompt=["a short prompt"] * 1500, max_tokens=4)
    assert e.value.status_code == 400 and e.value.body["code"] == "too_many_prompts"
    out = c.completions.create(model=cluster.model_name, prompt=["a short prompt"] * 40, max_tokens=4)
    assert len(out.choices) == 40
    assert health_status(cluster.node("decode-0").grpc_address) == "SERVING"
    wait_nothing_held(cluster, NODES)
