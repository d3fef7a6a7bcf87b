"""What ``pcp`` is refused with, at start and before any rank process starts, naming the values;
and how the setting reaches the engine from the cluster file and from ``LLM(..., pcp=N)``."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch

from pdserve.config.cluster import ClusterConfig
from pdserve.config.engine import EngineConfig, ParallelConfig
from pdserve.config.resolver import resolve_node_settings
from pdserve.engine.llm import LLM
from pdserve.errors import ConfigError

CPU: dict[str, Any] = dict(device="cpu", dtype="float32", max_model_len=256)


def _file(**prefill: object) -> dict:
    return {
        "model": "/ckpt/m",
        "nodes": [
            {"name": "p0", "role": "prefill", "grpc_port": 5001, "metrics_port": 5002} | prefill,
            {"name": "d0", "role": "decode", "grpc_port": 5003, "metrics_port": 5004},
        ],
    }


def test_parallel_config_refuses_pcp_with_tp_or_pp() -> None:
    assert ParallelConfig(prefill_context_parallel_size=4).prefill_context_parallel_size == 4
    with pytest.raises(ConfigError, match=r"pcp\) must be >= 1, got 0"):
        ParallelConfig(prefill_context_parallel_size=0)
    with pytest.raises(
        ConfigError, match=r"pcp\) 2 with tensor_parallel_size 2 and pipeline_parallel_size 1"
    ):
        ParallelConfig(prefill_context_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(
        ConfigError, match=r"pcp\) 2 with tensor_parallel_size 1 and pipeline_parallel_size 2"
    ):
        ParallelConfig(prefill_context_parallel_size=2, pipeline_parallel_size=2)


def test_cluster_file_pcp_reaches_the_engine_and_is_checked() -> None:
    resolved = resolve_node_settings(
        ClusterConfig.from_dict(_file(pcp=2)), "p0", is_multimodal=lambda _m: False
    )
    assert resolved.engine_config().parallel.prefill_context_parallel_size == 2
    with pytest.raises(ConfigError, match=r"node 'p0': pcp 2 runs on prefill and colocated .*tp 2, pp 1"):
        ClusterConfig.from_dict(_file(pcp=2, tp=2))
    decode_pcp = _file()
    decode_pcp["nodes"][1]["pcp"] = 2
    with pytest.raises(ConfigError, match=r"node 'd0': pcp 2 .*got role decode"):
        ClusterConfig.from_dict(decode_pcp)
    with pytest.raises(
        ConfigError, match=r"pcp must be >= 1 \(the number of prefill context parallel ranks\)"
    ):
        ClusterConfig.from_dict(_file(pcp=0))


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"async_scheduling": True}, r"pcp \(prefill_context_parallel_size\) 2 with async_scheduling true"),
        ({"kv_offload": {"cpu_bytes": 1 << 20}}, r"pcp \(prefill_context_parallel_size\) 2 with kv_offload"),
        (
            {"device": "cuda:7"},
            r"pcp \(prefill_context_parallel_size\) 2 on cuda:7: rank 1 needs GPU 8"
            if torch.cuda.is_available()
            else r"device 'cuda:7' requested but CUDA is not available",
        ),
    ],
)
def test_refused_before_any_rank_starts(tiny_models: Any, extra: dict[str, Any], match: str) -> None:
    before = len(mp.active_children())
    with pytest.raises(ConfigError, match=match):
        LLM(str(tiny_models["llama"]), pcp=2, **(CPU | extra))
    assert len(mp.active_children()) == before


def test_drafter_methods_pass(tiny_models: Any) -> None:
    """draft_model and mtp are accepted with pcp (every rank holds the drafter;
    tests/pcp/test_pcp_spec.py runs both)."""
    from pdserve.pcp.checks import check_pcp_config

    model = str(tiny_models["llama"])
    for spec in ({"method": "draft_model", "model": model}, {"method": "mtp"}):
        config = EngineConfig(
            model=model, parallel=ParallelConfig(prefill_context_parallel_size=2), speculative=spec
        )
        check_pcp_config(config)  # no ConfigError


def test_models_with_other_than_full_attention_are_refused(tiny_model_factory: Any) -> None:
    gemma = tiny_model_factory("gemma3", num_layers=2, max_position_embeddings=256)
    with pytest.raises(
        ConfigError, match=r"pcp \(prefill_context_parallel_size\) 2: model .* sliding_attention"
    ):
        LLM(str(gemma), pcp=2, **CPU)


def test_pcp_1_is_the_plain_runner(tiny_models: Any) -> None:
    from pdserve.engine.model_runner import ModelRunner

    with LLM(str(tiny_models["llama"]), pcp=1, **CPU) as llm:
        assert type(llm.engine.runner) is ModelRunner and llm.engine.runner.pcp is None
    assert EngineConfig(model="/m").parallel.prefill_context_parallel_size == 1
