"""A node's engine step counters (pdserve:engine_step_*) on its /metrics registry: in-process
colocated node, one pipeline stage and two (the counters live with the engine, in stage 0's
process), real engine, scraped in the exposition format the metrics port serves."""

from __future__ import annotations

import asyncio
import socket

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.config.engine import EngineConfig, ParallelConfig
from pdserve.config.node_spec import NodeSpec
from pdserve.engine.sampling_params import SamplingParams
from services.decode.server import DecodeNode

STEP_COUNTERS = (
    "engine_steps",
    "engine_step_sequences",
    "engine_step_tokens",
    "engine_step_decode_sequences",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(node: DecodeNode) -> dict[str, float]:
    """Sample name -> value for this node's samples (labels node / role checked)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(generate_latest(node.registry).decode()):
        for s in fam.samples:
            if s.labels.get("node") == node.opts.name and s.labels.get("role") == node.opts.role:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


@pytest.mark.parametrize("pp", [1, 2])
def test_step_counters_move_with_a_generation(tiny_models, pp) -> None:
    cfg = EngineConfig(
        model=str(tiny_models["llama"]),
        device="cpu",
        dtype="float32",
        parallel=ParallelConfig(pipeline_parallel_size=pp),
    )
    node = DecodeNode(NodeSpec.for_test(name="colo-m", role="colocated", engine=cfg, grpc_port=_free_port()))
    before = _scrape(node)
    sizes = node.engine.cache_sizes  # the KV sizing the start log names, as gauges
    assert before["pdserve:kv_blocks_total"] == sizes.num_blocks > 0
    assert before["pdserve:kv_cache_budget_bytes"] == sizes.budget_bytes > 0
    assert before["pdserve:max_model_len"] == node.engine.max_model_len == 2048
    for name in STEP_COUNTERS:
        assert before[f"pdserve:{name}_total"] == 0
    assert before["pdserve:kv_pull_seconds_count"] == 0  # a colocated node pulls nothing

    async def scenario() -> int:
        ready = asyncio.Event()
        serving = asyncio.create_task(node.serve(ready))
        await asyncio.wait_for(ready.wait(), 60)
        assert node.engine_loop is not None
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        gens = [node.engine_loop.generate(list(range(1 + i, 30 + i)), params, f"r{i}") for i in range(3)]

        async def drain(g) -> int:  # type: ignore[no-untyped-def]
            return sum([len(d.token_ids) async for d in g])

        ntok = sum(await asyncio.gather(*(drain(g) for g in gens)))
        node.request_stop()
        await asyncio.wait_for(serving, 30)
        return ntok

    try:
        assert asyncio.run(scenario()) == 18
        after = _scrape(node)
    finally:
        node.engine.close()
    steps = after["pdserve:engine_steps_total"]
    seqs = after["pdserve:engine_step_sequences_total"]
    toks = after["pdserve:engine_step_tokens_total"]
    decodes = after["pdserve:engine_step_decode_sequences_total"]
    # 3 prompts of 29 tokens, 6 tokens each: at least 6 steps (the last token is sampled in the
    # 6th step a request is in); every request's 5 later tokens are one-token chunks.
    assert steps >= 6
    assert seqs >= steps and toks >= seqs
    assert toks == 3 * 29 + 3 * 5
    assert decodes == 3 * 5
    assert seqs == decodes + 3  # one prompt chunk each (29 tokens fit the step budget)
