"""A prefill node with ``pcp: 2`` feeding a decode node, as real processes: the router, the
prefill node (rank 0 plus one spawned rank, gloo between them) and the decode node, KV over
Mooncake TE (TCP, loopback), driven by the official ``openai`` client.

Rank 0's KV cache holds every prompt token (the ranks all-gather each layer's K/V), so the
decode node pulls from rank 0's one endpoint as from a pcp 1 prefill node; the greedy text of
prompts of 300-2,000 tokens must equal the colocated pcp 1 engine's, and nothing stays held;
then a killed rank stops the idle prefill node. With MTP speculation on both nodes the prefill
node's module KV moves too, and the decode node drafts from it.
"""

from __future__ import annotations

import os
import random
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from tests.e2e import test_pp_e2e as pp_e2e
from tests.e2e.cluster import make_cluster_config, running_cluster

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.environ.get("PDSERVE_FULL_TESTS"),
        reason="~60 s each on 2 cores: PDSERVE_FULL_TESTS=1 (test_pcp_engine.py and test_pcp_spec.py run pcp 2 "
        "in process by default)",
    ),
]

LENGTHS = [300, 1999 - pp_e2e.NEW_TOKENS, 777, 20]  # the last one is replicated (under 2 blocks)


@pytest.fixture(scope="module")
def expected(tiny_model_factory) -> tuple[Path, list[list[int]], list[str]]:
    model = tiny_model_factory("llama", num_layers=4)
    rng = random.Random(29)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]
    with LLM(str(model), max_num_batched_tokens=512) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=pp_e2e.NEW_TOKENS, ignore_eos=True)
        texts = [o.outputs[0].text for o in llm.generate(prompts, params)]
    return model, prompts, texts


def test_pcp2_prefill_to_decode_equals_colocated_pcp1(expected, tmp_path) -> None:
    model, prompts, want = expected
    cfg = make_cluster_config(
        model,
        router={"local_prefill_max_tokens": 0},  # every request goes prefill -> decode
        **{"prefill-0": {"pcp": 2}},
        all={"max_num_batched_tokens": 512},
    )
    with running_cluster(cfg, tmp_path / "run") as rc:
        prefill = next(c for c in rc.children if c.name == "prefill-0")
        assert len(pp_e2e._stage_pids(prefill.proc.pid)) == 1  # rank 1's process
        with ThreadPoolExecutor(len(prompts)) as ex:
            got = list(ex.map(lambda p: pp_e2e._complete(rc, p), prompts))
        assert [n for _, n in got] == [pp_e2e.NEW_TOKENS] * len(prompts)
        for i, ((text, _), w) in enumerate(zip(got, want, strict=True)):
            assert text == w, f"prompt {i} ({len(prompts[i])} tokens): {text!r} vs {w!r}\n{rc.logs()}"
        pp_e2e._assert_nothing_held(rc)
        assert pp_e2e._node_metric(rc.node("prefill-0").metrics_port, "pdserve:kv_leases_expired_total") == 0
        # an idle node notices a dead rank: NOT_SERVING, then exit 1 naming it (docs/design.md §7)
        (rank1,) = pp_e2e._stage_pids(prefill.proc.pid)
        os.kill(rank1, signal.SIGKILL)
        assert prefill.proc.wait(timeout=30) == 1
        assert "PCP rank 1 exited" in prefill.log_path.read_text(errors="replace")


def test_pcp2_mtp_prefill_to_mtp_decode(tiny_model_factory, tmp_path) -> None:
    """A pcp 2 prefill node running the MTP module feeding an MTP decode node: the module's KV of
    a split prompt is computed on both ranks and all-gathered, and moves from rank 0's cache as
    one more layer (tests/pcp/test_pcp_spec.py checks those bytes against pcp 1's in process).
    Greedy text equals the colocated pcp 1 engine's without speculation; the decode node drafts."""
    model = tiny_model_factory("llama", num_layers=4, mtp=True)
    rng = random.Random(31)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]
    max_tokens = 20
    with LLM(str(model), max_num_batched_tokens=512) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        want = [o.outputs[0].text for o in llm.generate(prompts, params)]
    mtp = {"method": "mtp", "num_speculative_tokens": 3}
    cfg = make_cluster_config(
        model,
        router={"local_prefill_max_tokens": 0},
        **{"prefill-0": {"pcp": 2, "speculative": mtp}, "decode-0": {"speculative": mtp}},
        all={"max_num_batched_tokens": 512},
    )
    with running_cluster(cfg, tmp_path / "run") as rc:
        with ThreadPoolExecutor(len(prompts)) as ex:
            got = list(ex.map(lambda p: pp_e2e._complete(rc, p, max_tokens), prompts))
        assert [n for _, n in got] == [max_tokens] * len(prompts)
        for i, ((text, _), w) in enumerate(zip(got, want, strict=True)):
            assert text == w, f"prompt {i} ({len(prompts[i])} tokens): {text!r} vs {w!r}\n{rc.logs()}"
        port = rc.node("decode-0").metrics_port
        assert pp_e2e._node_metric(port, "pdserve:spec_decode_num_drafts_total") > 0
        pp_e2e._assert_nothing_held(rc)
