"""The LFM2-shaped model (short convolutions beside attention, their state in a KV group of its
own) through the router, a prefill node and a decode node (separate processes, Mooncake TCP),
asked with the official openai client: greedy text equals transformers' for prompts of 5 to 600
tokens straddling the state group's block size. About a minute on 2 cores: PDSERVE_FULL_TESTS=1
runs it (tests/kvtransfer/test_group_transfer.py checks what a push moves per group in the
default run)."""

from __future__ import annotations

import os
import random

import openai
import pytest

from pdserve.models.loader import load_tokenizer
from tests.e2e import cluster as cluster_ports
from tests.e2e.cluster import make_cluster_config, running_cluster
from tests.e2e.test_pd_transfer import _assert_nothing_held
from tests.engine.test_engine_parity import NEW_TOKENS
from tests.models.test_lfm2 import reference_full_forward

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("PDSERVE_FULL_TESTS"), reason="PDSERVE_FULL_TESTS=1 runs it"),
]


def test_lfm2_through_router_prefill_decode_equals_transformers(tiny_model_factory, tmp_path) -> None:
    model_dir = tiny_model_factory("lfm2", num_layers=4, max_position_embeddings=1024)
    rng = random.Random(11)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (5, 15, 16, 17, 150, 600)]
    tok = load_tokenizer(model_dir)
    want = [tok.decode(t, skip_special_tokens=True) for t, _ in reference_full_forward(model_dir, prompts)]
    cluster_ports._next_base[0] = random.Random().randrange(20000, 31000, 10)
    cfg = make_cluster_config(model_dir, router={"local_prefill_max_tokens": 0})  # every prompt P/D
    with running_cluster(cfg, tmp_path / "run") as rc:
        client = openai.OpenAI(base_url=rc.base_url, api_key="unused", max_retries=0)
        got = []
        for p in prompts:
            r = client.completions.create(
                model=rc.model_name,
                prompt=p,
                max_tokens=NEW_TOKENS,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            assert r.usage is not None and r.usage.completion_tokens == NEW_TOKENS
            got.append(r.choices[0].text)
        _assert_nothing_held(rc)
    # a random tiny model may meet a near-tie once; every other answer is transformers' own
    assert sum(a != b for a, b in zip(got, want, strict=True)) <= 1
