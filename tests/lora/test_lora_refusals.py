"""LoRA with TP > 1, PP > 1 or several router workers is refused at start, naming the values:
the slot stacks live in the node's own process (TP ranks and pipeline stages hold none), and
the adapter registry in one router process."""

from __future__ import annotations

import pytest

from pdserve.config.cluster import ClusterConfig
from pdserve.config.engine import EngineConfig, ParallelConfig
from pdserve.config.lora import LoRAConfig
from pdserve.errors import ConfigError


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_engine_refuses_lora_with_tp_or_pp(tp, pp):
    with pytest.raises(ConfigError, match=f"pipeline_parallel_size=1 only, got {tp} / {pp}"):
        EngineConfig(
            model="/m",
            lora=LoRAConfig(),
            parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        )


def _cluster(node_extra: dict, router: dict | None = None) -> dict:
    return {
        "model": "/ckpt/tiny",
        "router": router or {},
        "lora": {"max_loras": 2},
        "nodes": [
            {"name": "prefill-0", "role": "prefill", "grpc_port": 50061, "metrics_port": 9101, **node_extra},
            {"name": "decode-0", "role": "decode", "grpc_port": 50062, "metrics_port": 9102},
        ],
    }


def test_cluster_refuses_lora_with_tp_pp_or_router_workers():
    ClusterConfig.from_dict(_cluster({}))  # tp 1, pp 1, one router worker: served
    with pytest.raises(ConfigError, match=r"lora on nodes prefill-0 \(tp=2, pp=1\)"):
        ClusterConfig.from_dict(_cluster({"tp": 2}))
    with pytest.raises(ConfigError, match=r"lora on nodes prefill-0 \(tp=1, pp=2\)"):
        ClusterConfig.from_dict(_cluster({"pp": 2}))
    with pytest.raises(ConfigError, match=r"router\.workers=2"):
        ClusterConfig.from_dict(_cluster({}, {"workers": 2}))
