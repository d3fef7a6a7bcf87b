"""The node's Steps front end in its own process (decode-0 with ``frontend: process``).

Token streams through router -> front-end process -> node equal the in-process engine's (greedy
and seeded, streamed and not, colocated prompts and P/D prompts); the router found the front end
through GetLoad; a malformed command is INVALID_ARGUMENT and holds nothing; a dead front end
takes the node out of service (exit 1) instead of leaving streams hanging.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time

import grpc
import httpx
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.rpc import convert
from pdserve.rpc import node_pb2 as pb
from tests.e2e.cluster import make_cluster_config, running_cluster
from tests.e2e.test_served_e2e import _wait_free, assert_streams_equal_in_process, check_flush_interval

pytestmark = pytest.mark.slow
STREAM_FLUSH_MS = 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    cfg = make_cluster_config(
        tiny_models["llama"],
        # stream_flush_ms: streamed tokens are held and merged too (the token-equality tests
        # below then also cover grouped SSE chunks); test_stream_flush_* checks the grouping
        router={"local_prefill_max_tokens": 16, "stream_flush_ms": STREAM_FLUSH_MS},
        **{"decode-0": {"frontend": "process", "frontend_port": _free_port()}},
    )
    with running_cluster(cfg, tmp_path_factory.mktemp("steps-frontend")) as rc:
        yield rc


def _metric(url: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", httpx.get(url).text, re.M)
    assert m, f"{name} not in {url}"
    return float(m.group(1))


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_streams_through_the_frontend_equal_the_in_process_engine(cluster, tiny_models, seeded) -> None:
    d0 = cluster.node("decode-0")
    rep = cluster.load("decode-0")
    assert rep.steps_address == f"127.0.0.1:{d0.frontend_port}"
    assert rep.steps_socket == ""  # gRPC through the front end, not the Steps socket
    metrics = f"http://127.0.0.1:{d0.metrics_port}/metrics"
    assert_streams_equal_in_process(cluster, tiny_models["llama"], seeded)
    # every leg went through the front-end process: the router opened its stream there
    assert _metric(metrics, "pdserve:frontend_steps_sessions_total") >= 1
    _wait_free(cluster)


def test_inline_has_no_steps_address(tiny_models, tmp_path_factory) -> None:
    """frontend: inline: no front-end process, no steps_address (the node's own gRPC port)."""
    cfg = make_cluster_config(tiny_models["llama"], **{"decode-0": {"frontend": "inline"}})
    with running_cluster(cfg, tmp_path_factory.mktemp("steps-inline"), router=False) as rc:
        rep = rc.load("decode-0")
        assert (rep.steps_address, rep.steps_socket) == ("", "")
        log = next(c for c in rc.children if c.name == "decode-0").log_path.read_text()
        assert "Steps front end (pid" not in log and "Steps socket" not in log


def test_stream_flush_groups_streamed_tokens_and_changes_none(cluster) -> None:
    """router.stream_flush_ms: a streamed answer (local prompt and P/D prompt) has the same text
    and token count as the non-streamed one, in far fewer SSE chunks than tokens."""
    import asyncio

    from tests.e2e.test_served_e2e import _served

    n = 200
    bodies = [
        {"model": cluster.model_name, "prompt": p, "max_tokens": n, "ignore_eos": True, "temperature": 0.0}
        for p in ([11, 12, 13], list(range(30, 70)))  # under / over local_prefill_max_tokens
    ]
    streamed = asyncio.run(_served(cluster, bodies, True))
    whole = asyncio.run(_served(cluster, bodies, False))
    for (text, count, chunks), (want_text, want_count, _) in zip(streamed, whole, strict=True):
        assert (text, count) == (want_text, want_count) and count == n
        # ~n steps of a few ms each, merged per 40 ms window: a handful of chunks, not n
        assert 2 <= chunks <= n // 4, chunks
    _wait_free(cluster)


def test_a_flush_interval_is_kept_by_the_engine_threads_writes(cluster) -> None:
    """Non-streaming requests' tokens are merged on the engine thread (DirectSteps.hold)."""
    check_flush_interval(cluster, cluster.load("decode-0").steps_address)


def test_a_malformed_command_is_invalid_argument_and_holds_nothing(cluster) -> None:
    d0 = cluster.node("decode-0")
    with grpc.insecure_channel(f"127.0.0.1:{d0.frontend_port}") as ch:
        steps = ch.stream_stream("/pdserve.rpc.DecodeService/Steps")  # raw bytes both ways
        with pytest.raises(grpc.RpcError) as e:
            list(steps(iter([b"\xff\xff\xff"]), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed StepCommand" in (e.value.details() or "")
        # a well-formed stream on the same front end still works: one request, to its end
        req = pb.DecodeRequest(
            request_id="fe-ok",
            prompt_token_ids=[5, 6, 7],
            sampling=convert.sampling_to_pb(SamplingParams(max_tokens=3, ignore_eos=True)),
        )
        batches = [
            pb.StepBatch.FromString(b)
            for b in steps(iter([pb.StepCommand(start=[req]).SerializeToString()]), timeout=30)
        ]
        deltas = [d for b in batches for d in b.deltas]
        assert sum(len(d.token_ids) for d in deltas) == 3, [str(b) for b in batches]
        assert deltas[-1].finish_reason == "length"
    _wait_free(cluster)


def test_a_dead_frontend_takes_the_node_out_of_service(tiny_models, tmp_path_factory) -> None:
    cfg = make_cluster_config(
        tiny_models["llama"], **{"decode-0": {"frontend": "process", "frontend_port": _free_port()}}
    )
    with running_cluster(cfg, tmp_path_factory.mktemp("steps-frontend-death")) as rc:
        node = next(c for c in rc.children if c.name == "decode-0")
        m = re.search(r"Steps front end \(pid (\d+)\)", node.log_path.read_text())
        assert m, node.log_path.read_text()[-2000:]
        os.kill(int(m.group(1)), signal.SIGKILL)
        deadline = time.monotonic() + 20
        while node.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert node.proc.returncode == 1, node.log_path.read_text()[-2000:]
        assert "Steps front-end process exited" in node.log_path.read_text()


def test_a_stopped_frontend_takes_the_node_out_of_service(tiny_models, tmp_path_factory) -> None:
    """SIGSTOP: the process lives but answers nothing, and every stream through it is stuck.
    Its heartbeat goes unanswered; past FRONTEND_STALL_S the node turns NOT_SERVING and exits 1
    for its supervisor to restart it (liveness alone kept it in service)."""
    from services.node import FRONTEND_STALL_S
    from tests.e2e.lifecycle_helpers import health_status

    cfg = make_cluster_config(tiny_models["llama"], **{"decode-0": {"frontend": "process"}})
    with running_cluster(cfg, tmp_path_factory.mktemp("steps-frontend-stop"), router=False) as rc:
        node = next(c for c in rc.children if c.name == "decode-0")
        m = re.search(r"Steps front end \(pid (\d+)\)", node.log_path.read_text())
        assert m, node.log_path.read_text()[-2000:]
        fe_pid = int(m.group(1))
        address = rc.cluster.node("decode-0").grpc_address
        assert health_status(address) == "SERVING"
        os.kill(fe_pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            deadline = t0 + FRONTEND_STALL_S + 15
            while node.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            waited = time.monotonic() - t0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(fe_pid, signal.SIGKILL)
        log = node.log_path.read_text()
        assert node.proc.returncode == 1, log[-2000:]
        assert "has not answered for" in log, log[-2000:]
        assert FRONTEND_STALL_S <= waited < FRONTEND_STALL_S + 15, waited
