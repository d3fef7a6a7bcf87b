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


def test_a_hybrid_models_kv_groups_each_have_their_gauges(tiny_model_factory) -> None:
    """Gemma-3-shaped (sliding-window layers with a pool of their own): past the window the
    sliding group holds 3 blocks and the full-attention group 16; kv_group_blocks_* give both,
    and kv_cache_usage_perc is the fuller pool's share (the one that stops admission first)."""
    model_dir = tiny_model_factory("gemma3", num_layers=4, max_position_embeddings=1024)
    cfg = EngineConfig(model=str(model_dir), device="cpu", dtype="float32")
    node = DecodeNode(NodeSpec.for_test(name="colo-g", role="colocated", engine=cfg, grpc_port=_free_port()))
    try:
        eng = node.engine
        assert eng.kv.groups is not None and eng.kv.block_size == 16
        prompt = [(7 * i) % eng.arch.vocab_size for i in range(150)]
        req = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True), "g")
        while len(req.output_token_ids) < 92:  # position 240 computed: blocks 13..15 of the window
            eng.step()
        fams = {
            f.name: {s.labels.get("group"): s.value for s in f.samples if s.labels.get("node") == "colo-g"}
            for f in text_string_to_metric_families(generate_latest(node.registry).decode())
        }
    finally:
        node.engine.close()
    used, total = fams["pdserve:kv_group_blocks_used"], fams["pdserve:kv_group_blocks_total"]
    assert used == {"0": 16.0, "1": 3.0}
    assert total["0"] == fams["pdserve:kv_blocks_total"][None] == eng.cache_sizes.num_blocks
    assert 3 < total["1"] < total["0"]  # the sliding group's pool is sized by its window
    usage = fams["pdserve:kv_cache_usage_perc"][None]
    assert usage == max(16 / total["0"], 3 / total["1"]) == 3 / total["1"]
