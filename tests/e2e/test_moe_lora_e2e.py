"""A Mixtral-shaped model with an adapter on its attention and experts through router -> prefill
-> decode (real processes, Mooncake TCP) and the official openai client: greedy tokens of the
adapter's and the base model's prompts, sent together, equal transformers + peft PeftModel."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random

import openai
import pytest

from tests.e2e import cluster as cluster_ports
from tests.e2e.cluster import make_cluster_config, running_cluster
from tests.lora.adapters import make_adapter, peft_merged_greedy
from tests.lora.test_moe_lora import MOE_ADAPTERS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.environ.get("PDSERVE_FULL_TESTS"),
        reason="PDSERVE_FULL_TESTS=1 (the MoE adapter path is covered in-process by tests/lora/test_moe_lora.py, "
        "the P/D adapter path by tests/e2e/test_lora_e2e.py)",
    ),
]

NEW_TOKENS = 8


def test_moe_adapter_through_prefill_and_decode(tiny_model_factory, tmp_path_factory):
    model_dir = tiny_model_factory("mixtral")
    root = tmp_path_factory.mktemp("moe-adapters")
    path = make_adapter(model_dir, root / "rslora", seed=3, **MOE_ADAPTERS["rslora"])
    rng = random.Random(11)
    jobs = [
        ("rslora" if i % 2 else "", [rng.randrange(3, 500) for _ in range(rng.randint(20, 80))])
        for i in range(6)
    ]
    from pdserve.models.loader import load_tokenizer

    tok = load_tokenizer(model_dir)
    want = [
        tok.decode(t, skip_special_tokens=True)
        for t in peft_merged_greedy(model_dir, {"rslora": path}, jobs, NEW_TOKENS)
    ]
    cluster_ports._next_base[0] = random.Random().randrange(20000, 31000, 10)
    cfg = make_cluster_config(model_dir, router={"local_prefill_max_tokens": 16})
    data = cfg.model_dump(mode="json", exclude_unset=True)
    data["lora"] = {"max_loras": 1, "max_lora_rank": 4, "modules": {"rslora": str(path)}}
    cfg = type(cfg).from_dict(data)
    with running_cluster(cfg, tmp_path_factory.mktemp("moe-lora-e2e")) as rc:
        client = openai.OpenAI(base_url=rc.base_url, api_key="unused", max_retries=0)

        def complete(job: tuple[str, list[int]]) -> str:
            r = client.completions.create(
                model=job[0] or rc.model_name,
                prompt=job[1],
                max_tokens=NEW_TOKENS,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            return r.choices[0].text

        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(complete, jobs))
    assert got == want
