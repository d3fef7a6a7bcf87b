"""A decode node whose engine thread is stuck in one step past ``step_timeout_s`` says so (real
processes: router, prefill-0, decode-0, decode-1; official openai client).

decode-0 runs with step_timeout_s=1 and the test-only ``faults.engine_stall_on_sigusr2_s``: SIGUSR2
holds its engine thread STALL_S seconds in one command, as a wedged step would. Its watchdog turns
gRPC health NOT_SERVING and ends its streams with an error; GetLoad answers UNAVAILABLE, so the
router takes it out of rotation and new requests go to decode-1; once the step ends, the node
is SERVING and in rotation again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import openai
import pytest

from pdserve.config.cluster import ClusterConfig
from tests.e2e.cluster import in_rotation, running_cluster
from tests.e2e.lifecycle_helpers import health_status, isolated_cluster_config, wait_nothing_held

pytestmark = pytest.mark.slow
STEP_TIMEOUT_S = 1.0
STALL_S = 5.0
NODES = ["decode-0", "decode-1"]


def _two_decode_config(model_dir) -> ClusterConfig:
    """router + decode-0 (step_timeout_s 1, the stall fault) + decode-1 (defaults); no prefill
    node (one process fewer to start): the short prompts prefill on decode."""
    wedging = {"step_timeout_s": STEP_TIMEOUT_S, "faults": {"engine_stall_on_sigusr2_s": STALL_S}}
    data = isolated_cluster_config(model_dir, **{"decode-0": wedging}).model_dump(
        mode="json", exclude_unset=True
    )
    d0 = next(n for n in data["nodes"] if n["name"] == "decode-0")
    base = data["router"]["port"]
    d1 = {k: v for k, v in d0.items() if k not in wedging}
    data["nodes"] = [d0]
    data["nodes"].append({**d1, "name": "decode-1", "grpc_port": base + 5, "metrics_port": base + 6})
    return ClusterConfig.from_dict(data)


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    with running_cluster(_two_decode_config(tiny_models["llama"]), tmp_path_factory.mktemp("wedge")) as rc:
        yield rc


def _wait(what: str, cond, deadline: float) -> float:
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within the deadline"
        time.sleep(0.05)
    return time.monotonic()


def test_a_wedged_engine_turns_not_serving_leaves_rotation_and_comes_back(cluster) -> None:
    c = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=30)
    dec0 = cluster.node("decode-0")
    _wait("decode-0 in rotation", lambda: in_rotation(cluster, "decode-0") == 1.0, time.monotonic() + 10)
    # both decode nodes idle: least_loaded takes the first, decode-0
    stream = c.completions.create(
        model=cluster.model_name,
        prompt="a stream on decode-0",
        max_tokens=1500,
        stream=True,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    n = 0
    t0 = 0.0
    with pytest.raises(openai.APIError) as ei:
        for _chunk in stream:
            n += 1
            if n == 5:
                t0 = time.monotonic()
                child = next(ch for ch in cluster.children if ch.name == "decode-0")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.proc.pid, signal.SIGUSR2)
    ended_s = time.monotonic() - t0
    assert t0 and ended_s < STEP_TIMEOUT_S + 2.0, ended_s
    assert "step_timeout_s" in str(ei.value.message), ei.value.message
    assert health_status(dec0.grpc_address) == "NOT_SERVING"
    out_s = _wait("decode-0 out of rotation", lambda: in_rotation(cluster, "decode-0") == 0.0, t0 + 3.5) - t0
    # while decode-0 is still stuck, requests go to decode-1 and complete
    for i in range(3):
        r = c.completions.create(
            model=cluster.model_name,
            prompt=f"served elsewhere {i}",
            max_tokens=4,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].finish_reason == "length"
    assert time.monotonic() - t0 < STALL_S, "the requests were not served while decode-0 was stuck"
    assert health_status(dec0.grpc_address) == "NOT_SERVING"
    # the stuck step ends: SERVING and in rotation again, and decode-0 serves
    back_s = (
        _wait(
            "decode-0 SERVING again", lambda: health_status(dec0.grpc_address) == "SERVING", t0 + STALL_S + 3
        )
        - t0
    )
    _wait("decode-0 back in rotation", lambda: in_rotation(cluster, "decode-0") == 1.0, t0 + STALL_S + 5)
    print(
        f"stream ended {ended_s:.2f} s, out of rotation {out_s:.2f} s, SERVING again {back_s:.2f} s after SIGUSR2"
    )
    r = c.completions.create(
        model=cluster.model_name, prompt="back", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    wait_nothing_held(cluster, NODES, timeout_s=10)
