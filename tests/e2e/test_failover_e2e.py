"""Failover with real node processes: reprefill, leases kept by a queue, frozen peers,
the circuit breaker, readiness and restarts. Two prefill nodes, one decode node (reprefill policy).

The router's lifecycle runs in-process (``tests/e2e/faults.PhasedBackend`` = ``PDBackend`` plus
a phase hook), so a fault lands at an exact phase of one request.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from services.router.backend import BackendRequest
from tests.e2e.cluster import running_cluster
from tests.e2e.faults import backend_for, freeze_for, signal_node
from tests.e2e.lifecycle_helpers import two_prefill_config, wait_nothing_held

pytestmark = pytest.mark.slow
NODES = ["prefill-0", "prefill-1", "decode-0"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPT = [(7 * i) % 500 + 1 for i in range(90)]


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    cfg = two_prefill_config(
        tiny_models["llama"],
        all={"kv_lease_s": 3.0},
        **{
            "decode-0": {
                "kv_load_failure_policy": "reprefill",
                "kv_keepalive_s": 0.5,
                "max_num_seqs": 1,
                "kv_checksum": True,
            }
        },
    )
    with running_cluster(cfg, tmp_path_factory.mktemp("failover"), router=False) as rc:
        yield rc


async def _run(backend, req: BackendRequest) -> tuple[list[int], str | None, float]:
    t0 = time.monotonic()
    toks: list[int] = []
    err = None
    async for d in backend.generate(req):
        toks += d.token_ids
        if d.finish_reason == "error":
            err = d.error
    return toks, err, time.monotonic() - t0


def _drop_hold(rc, phase_wanted: str):
    async def hook(phase: str, info: dict) -> None:
        if phase == phase_wanted:
            p = rc.node(info["node"])
            async with grpc.aio.insecure_channel(p.grpc_address) as ch:
                await pb_grpc.PrefillServiceStub(ch).Abort(
                    pb.AbortRequest(transfer_ids=[info["transfer_id"]]), timeout=5
                )

    return hook


def test_reprefill_when_the_transfer_is_dropped(cluster) -> None:
    async def main() -> None:
        plain = backend_for(cluster)
        want, err, _ = await _run(plain, BackendRequest("plain", PROMPT, GREEDY))
        assert err is None and len(want) == 24
        await plain.close()
        chaos = backend_for(cluster, hook=_drop_hold(cluster, "after_prefill"))
        got, err, _ = await _run(chaos, BackendRequest("dropped", PROMPT, GREEDY))
        assert err is None, err
        assert got == want  # the client's first token kept, the rest from the re-prefilled KV
        assert chaos.path_total.labels("reprefill")._value.get() == 1
        assert chaos.leg_failures.labels("decode", "KV_LOAD_FAILED")._value.get() == 1
        await chaos.close()

    asyncio.run(main())
    wait_nothing_held(cluster, NODES)


def test_a_request_queued_on_decode_keeps_its_prefill_lease(cluster) -> None:
    """decode runs one sequence at a time; the second request waits there longer than the 3 s
    lease; decode's KeepAlive keeps prefill's hold, so its pull succeeds (no recompute)."""

    async def main() -> None:
        b = backend_for(cluster, local_prefill_max_tokens=16, request_timeout_s=120)
        # Decode's first-token deadline must cover the queue wait here.
        b.policy = type(b.policy)(**{**b.policy.__dict__, "decode_first_token_timeout_s": 60.0})
        long = SamplingParams(temperature=0.0, max_tokens=1800, ignore_eos=True)
        # Two long ones ahead (FCFS, one at a time): the wait outlasts the lease however fast
        # the decode node streams.
        ahead = [
            asyncio.ensure_future(_run(b, BackendRequest(f"long-local-{i}", [1, 2, 3 + i], long)))
            for i in range(2)
        ]
        await asyncio.sleep(0.3)
        toks, err, took = await _run(b, BackendRequest("queued", PROMPT, GREEDY))
        lerrs = [r[1] for r in await asyncio.gather(*ahead)]
        assert err is None and lerrs == [None, None] and len(toks) == 24
        assert took > 3.5, f"the request was not queued past the lease ({took:.1f} s); make the first longer"
        await b.close()

    before = _decode_metric(cluster, "pdserve:kv_transfer_failures_total")
    asyncio.run(main())
    assert _decode_metric(cluster, "pdserve:kv_transfer_failures_total") == before  # pulled, not recomputed
    assert _decode_metric(cluster, "pdserve:kv_keepalive_transfers_total") > 0
    # kv_checksum is on for decode-0: every pull so far was verified, none mismatched.
    assert _decode_metric(cluster, "pdserve:kv_checksums_verified_total") >= 2
    assert _decode_metric(cluster, "pdserve:kv_checksum_mismatches_total") == 0
    wait_nothing_held(cluster, NODES)


def _decode_metric(rc, name: str) -> float:
    import httpx

    d = rc.node("decode-0")
    text = httpx.get(f"http://{d.metrics_address}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_frozen_decode_is_noticed_in_seconds_and_probed_back(cluster) -> None:
    async def hook(phase: str, info: dict) -> None:
        if phase == "during_decode":
            await freeze_for(cluster, "decode-0", 4.0)

    async def main() -> None:
        b = backend_for(cluster, hook=hook, inter_token_timeout_s=1.5, breaker_failures=1, breaker_open_s=3.0)
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        _, err, took = await _run(b, BackendRequest("frozen", PROMPT, long))
        assert err is not None and "sent nothing" in err
        assert took < 6, f"a frozen decode took {took:.1f} s to notice"
        d = b.decode[0]
        assert not d.breaker.available()  # out of rotation
        assert not await b.ready()  # and /ready says so: no path can serve now
        await asyncio.sleep(4.5)  # thawed; breaker half-open
        assert d.breaker.available()
        b.hook = None
        toks, err, _ = await _run(b, BackendRequest("probe", PROMPT, GREEDY))
        assert err is None and len(toks) == 24 and d.breaker.available() and await b.ready()
        await b.close()

    asyncio.run(main())
    wait_nothing_held(cluster, NODES, timeout_s=10)


def test_prefill_kill_and_restart(cluster) -> None:
    """kill -9 of a prefill node at each phase: the request ends (served elsewhere); a restart
    is seen as a new epoch and the node is used again; /ready stays consistent."""
    from services.launcher import start_child, wait_ready

    async def main() -> None:
        async def kill_p0(phase: str, info: dict) -> None:
            if info.get("node") == "prefill-0" and phase == "before_prefill":
                signal_node(cluster, "prefill-0", signal.SIGKILL)

        b = backend_for(cluster, hook=kill_p0, policy="round_robin")
        b.start()
        await asyncio.sleep(1.0)
        epoch0 = b.prefill[0].epoch
        outs = await asyncio.gather(*(_run(b, BackendRequest(f"k{i}", PROMPT, GREEDY)) for i in range(4)))
        assert all(err is None and len(t) == 24 for t, err, _ in outs), outs
        assert await b.ready()  # decode serves; prefill-1 takes the disaggregated path
        # restart prefill-0
        child = next(c for c in cluster.children if c.name == "prefill-0")
        cluster.children.remove(child)
        fresh = start_child(
            cluster.run_dir / "cluster.yaml", "prefill", "prefill-0", cluster.run_dir / "restart"
        )
        cluster.children.append(fresh)
        wait_ready(cluster.cluster, cluster.children, timeout_s=120, router=False)
        b.hook = None
        for _ in range(40):
            if b.prefill[0].epoch not in ("", epoch0) and b.prefill[0].available:
                break
            await asyncio.sleep(0.25)
        assert b.prefill[0].epoch != epoch0 and b.node_restarts.labels("prefill-0")._value.get() == 1
        outs = await asyncio.gather(*(_run(b, BackendRequest(f"r{i}", PROMPT, GREEDY)) for i in range(4)))
        assert all(err is None for _, err, _ in outs)
        await b.close()

    (cluster.run_dir / "restart").mkdir(exist_ok=True)
    asyncio.run(main())
    wait_nothing_held(cluster, NODES)
