"""The Gemma-3-shaped model through a prefill node feeding a decode node (separate processes,
Mooncake TCP): greedy tokens equal transformers' for prompts straddling the sliding window.
About a minute on 2 cores: PDSERVE_FULL_TESTS=1 runs it (the LLM parity test covers the model
in the default run)."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.models.make_model import TINY_SLIDING_WINDOW
from tests.e2e.cluster import make_cluster_config, running_cluster
from tests.e2e.test_offload_pd_e2e import _generate
from tests.e2e.test_pd_transfer import _assert_nothing_held
from tests.engine.test_engine_parity import NEW_TOKENS, _reference, compare_greedy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("PDSERVE_FULL_TESTS"), reason="PDSERVE_FULL_TESTS=1 runs it"),
]

W = TINY_SLIDING_WINDOW


def test_gemma3_disaggregated_equals_transformers(tiny_model_factory, tmp_path) -> None:
    model_dir = tiny_model_factory("gemma3", num_layers=4, max_position_embeddings=1024)
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (5, W - 1, W + 1, 3 * W + 5, 200)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    cfg = make_cluster_config(model_dir)
    with running_cluster(cfg, tmp_path / "run", router=False) as rc:
        ours = [asyncio.run(_generate(rc, p, params, f"g{i}")) for i, p in enumerate(prompts)]
        _assert_nothing_held(rc)
    assert compare_greedy(ours, _reference(model_dir, prompts)) <= 1
