"""Prefill and decode nodes with tensor parallelism, as real processes: the router, a prefill
node of P TP ranks and a decode node of D TP ranks (gloo between a node's ranks), every rank with
its own Mooncake TE endpoint (TCP, loopback) and its own KV regions, driven by the official
``openai`` client. With different TP sizes each pull moves KV-head slices between rank layouts
(``pdserve.kvtransfer.head_slices``).

Greedy output must equal the colocated single-rank engine's, which equals ``transformers``
(``test_pp_e2e.expected``); afterwards nothing is held on either node.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e import test_pp_e2e as pp_e2e
from tests.e2e.cluster import RunningCluster, make_cluster_config, running_cluster

llama4 = pp_e2e.llama4  # module fixtures: the 4-layer tiny Llama, its prompts and greedy answers
expected = pp_e2e.expected
_assert_nothing_held, _client, _complete = pp_e2e._assert_nothing_held, pp_e2e._client, pp_e2e._complete

pytestmark = pytest.mark.slow

LEASE_S = 6.0


def _cluster(model: Path, p: dict[str, int], d: dict[str, int], **all_nodes: object) -> object:
    return make_cluster_config(
        model,
        router={"local_prefill_max_tokens": 0},  # every request goes prefill -> decode
        **{"prefill-0": p, "decode-0": d},
        all={"max_num_batched_tokens": 256, **all_nodes},
    )


def _endpoints(p_pp: int, p_tp: int) -> list[tuple[int, int]]:
    return [(pp, tp) for pp in range(p_pp) for tp in range(p_tp)]


def check_tp_pair(rc: RunningCluster, p: dict[str, int], d: dict[str, int], expected) -> None:
    """Greedy parity for 8 concurrent prompts, then every endpoint of both nodes moved KV, none
    failed, and every hold was freed by its consumers' pulls (not by the lease)."""
    prompts, want_tokens, want_text = expected
    sizes = {}
    for name, cfg in (("prefill-0", p), ("decode-0", d)):
        pp, tp = cfg.get("pp", 1), cfg.get("tp", 1)
        sizes[name] = (pp, tp)
        stages = rc.load(name).stages
        assert [(s.stage.pp_rank, s.stage.tp_rank) for s in stages] == _endpoints(pp, tp), stages
        assert all(s.stage.session and s.stage.tp_size == tp for s in stages), stages
        assert len({s.stage.session for s in stages}) == len(stages)  # one TE per rank / stage
    with ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(lambda pr: _complete(rc, pr), prompts))
    assert [n for _, n in got] == [len(t) for t in want_tokens]
    for i, ((text, _), want) in enumerate(zip(got, want_text, strict=True)):
        assert text == want, f"prompt {i} ({len(prompts[i])} tokens): {text!r} vs {want!r}\n{rc.logs()}"
    _assert_nothing_held(rc)
    for name, (pp, tp) in sizes.items():
        text = httpx.get(f"http://127.0.0.1:{rc.node(name).metrics_port}/metrics").text
        for pp_rank, tp_rank in _endpoints(pp, tp):
            want = f'stage="{pp_rank}",tp_rank="{tp_rank}"'
            for metric, moved in (
                ("stage_kv_transfer_bytes_total", True),
                ("stage_kv_transfer_failures_total", False),
            ):
                v = [
                    float(ln.split()[-1])
                    for ln in text.splitlines()
                    if ln.startswith(f"pdserve:{metric}{{") and want in ln
                ]
                assert len(v) == 1 and (v[0] > 0 if moved else v[0] == 0), (name, metric, want, v)
    assert pp_e2e._node_metric(rc.node("prefill-0").metrics_port, "pdserve:kv_leases_expired_total") == 0


# CI runs one heterogeneous pair (prefill TP 1 -> decode TP 2: each decode rank's pull moves its
# head slice of the prefill rank's blocks), on the cluster the kill test then takes down. The
# rest of the matrix, each pair its own cluster (~60 s each on 2 cores), runs with
# PDSERVE_FULL_TESTS=1 or PDSERVE_PP_MATRIX=1; bench/tp_matrix.sh runs it all.
PAIRS: list[tuple[dict[str, int], dict[str, int]]] = []
if os.environ.get("PDSERVE_FULL_TESTS") or os.environ.get("PDSERVE_PP_MATRIX"):
    PAIRS = [
        ({"tp": 1}, {"tp": 1}),
        ({"tp": 2}, {"tp": 1}),
        ({"tp": 2}, {"tp": 2}),
        ({"pp": 2}, {"tp": 2}),
        ({"tp": 2}, {"pp": 2}),
    ]


def _ids(c: dict[str, int]) -> str:
    return "-".join(f"{k}{v}" for k, v in c.items())


@pytest.mark.parametrize(("p", "d"), PAIRS, ids=_ids)
def test_tp_greedy_equals_transformers(p, d, llama4, expected, tmp_path) -> None:
    with running_cluster(_cluster(llama4, p, d), tmp_path / "run") as rc:
        check_tp_pair(rc, p, d, expected)


@pytest.fixture(scope="module")
def cluster_12(llama4, tmp_path_factory):
    """P tp=1 -> D tp=2 behind the router; the kill test below ends it (it runs last)."""
    cfg = _cluster(llama4, {"tp": 1}, {"tp": 2}, kv_lease_s=LEASE_S, kv_keepalive_s=1.0)
    with running_cluster(cfg, tmp_path_factory.mktemp("tp12")) as rc:
        yield rc


def test_tp1_to_tp2_greedy_equals_transformers(cluster_12, expected) -> None:
    check_tp_pair(cluster_12, {"tp": 1}, {"tp": 2}, expected)


def test_killing_a_decode_tp_rank_fails_in_flight_and_frees_the_peer(cluster_12) -> None:
    """Runs after the greedy test on the same cluster (it takes decode-0 down for good): its
    streams end with an error naming the rank, the node exits, and the prefill peer's hold for a
    decode leg that never comes is freed by its lease."""
    pp_e2e.kill_decode_worker_and_check_peer(cluster_12, "TP rank 1", LEASE_S)
