"""A prefill node answers a returning conversation from its offload tier: prefill and decode as
separate processes, KV through Mooncake TCP. The prefill node's device cache holds a few dozen
blocks; other long prompts evict conversation A there, and A's next turn loads A's blocks from
the host tier (counted), computes only the rest, and decodes what transformers does."""

from __future__ import annotations

import asyncio
import os
import random

import httpx
import pytest

from pdserve.engine.sampling_params import SamplingParams
from services.router.backend import BackendRequest
from services.router.pd_backend import PDBackend, RouterPolicy
from tests.e2e.cluster import make_cluster_config, running_cluster
from tests.e2e.test_pd_transfer import _assert_nothing_held, _metric
from tests.engine.test_engine_parity import NEW_TOKENS, _reference, compare_greedy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.environ.get("PDSERVE_FULL_TESTS"),
        reason="~15 s on 2 cores: PDSERVE_FULL_TESTS=1 runs it (CI checks the tier in-process, "
        "tests/kvoffload/test_offload_engine.py)",
    ),
]

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny llama: 2 layers x K,V x 16 tokens x 2 heads x 16 dims, fp32


async def _generate(rc, prompt: list[int], params: SamplingParams, rid: str) -> list[int]:
    p, d = rc.node("prefill-0"), rc.node("decode-0")
    backend = PDBackend(
        [(p.name, p.grpc_address)], [(d.name, d.grpc_address)], RouterPolicy(local_prefill_max_tokens=0)
    )
    toks: list[int] = []
    try:
        async for delta in backend.generate(BackendRequest(rid, prompt, params)):
            assert delta.finish_reason != "error", delta.error
            toks += delta.token_ids
    finally:
        await backend.close()
    return toks


def _offload_node(pp: int) -> dict[str, object]:
    """40 device blocks (of each stage's layers) over a host tier of 400 whole blocks."""
    return {
        "pp": pp,
        "kv_cache_memory_bytes": 40 * BLOCK_BYTES // pp,
        "kv_offload": {"cpu_bytes": 400 * BLOCK_BYTES},
    }


@pytest.mark.parametrize(
    ("prefill_pp", "decode_offload_pp"),
    [(1, None), (2, None), (1, 2)],
    ids=["pp1", "prefill-pp2", "decode-pp2-offload"],
)
def test_prefill_node_answers_from_its_offload_tier(
    prefill_pp: int, decode_offload_pp: int | None, tiny_models, tmp_path
) -> None:
    """pp 2 on the prefill node: each stage offloads its own layer and the hit is the same; a
    decode node with pp 2 and a tier stores evicted blocks on every stage before pushes land."""
    model_dir = tiny_models["llama"]
    nodes: dict[str, object] = {"prefill-0": _offload_node(prefill_pp)}
    if decode_offload_pp is not None:
        nodes["decode-0"] = _offload_node(decode_offload_pp)
    cfg = make_cluster_config(model_dir, **nodes)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    rng = random.Random(11)
    vocab = 512
    with running_cluster(cfg, tmp_path / "run", router=False) as rc:
        url = f"http://127.0.0.1:{rc.node('prefill-0').metrics_port}/metrics"
        turn1 = [rng.randrange(vocab) for _ in range(150)]
        out1 = asyncio.run(_generate(rc, turn1, params, "a1"))
        short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        for i in range(2):  # 2 x 25 blocks: A's 10 are evicted from the prefill node's 40
            asyncio.run(_generate(rc, [rng.randrange(vocab) for _ in range(400)], short, f"x{i}"))
        # Turn 2 repeats turn 1 and its answer (prefill computed KV for turn 1's prompt only:
        # decode made the answer), then new text.
        turn2 = turn1 + out1 + [rng.randrange(vocab) for _ in range(30)]
        before = httpx.get(url).text
        out2 = asyncio.run(_generate(rc, turn2, params, "a2"))
        after = httpx.get(url).text
        hit = _metric(after, "pdserve:kv_offload_hit_tokens_total")
        assert hit == 9 * 16, hit  # turn 1's 150 prompt tokens: 9 full blocks on the prefill node
        assert _metric(after, "pdserve:kv_offload_stored_blocks_total") > 0
        assert "pdserve:prefix_cache_declined_tokens_total{" in after
        prefilled = _metric(after, "pdserve:engine_prefill_tokens_total") - _metric(
            before, "pdserve:engine_prefill_tokens_total"
        )
        assert prefilled == len(turn2) - hit
        compare_greedy([out2], _reference(model_dir, [turn2]))
        if decode_offload_pp is not None:
            durl = f"http://127.0.0.1:{rc.node('decode-0').metrics_port}/metrics"
            assert _metric(httpx.get(durl).text, "pdserve:kv_offload_stored_blocks_total") > 0
        _assert_nothing_held(rc)
