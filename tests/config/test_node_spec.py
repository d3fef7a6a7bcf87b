"""The node's settings as it starts: enums validated once at load, and NodeSpec (the resolved
entry + the cluster-wide values + the EngineConfig + this host's addresses)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.config.choices import Dtype, KvLoadFailurePolicy, KvTransport, Role
from pdserve.config.cluster import ClusterConfig
from pdserve.config.engine import EngineConfig, ParallelConfig
from pdserve.config.node_spec import NodeSpec
from pdserve.config.resolver import resolve_node_settings
from pdserve.errors import ConfigError


def _text(_model: str) -> bool:
    return False


def _file(model: str, **decode: object) -> dict:
    return {
        "model": model,
        "shared_token": "t0k",
        "nodes": [
            {"name": "p0", "role": "prefill", "host": "10.0.0.5", "grpc_port": 5001, "metrics_port": 5002}
            | {"kv_lease_s": 12.0},
            {"name": "d0", "role": "decode", "host": "decode.svc.local", "grpc_port": 5003}
            | {"metrics_port": 5004, "kv_transport": "rdma", "kv_load_failure_policy": "reprefill"}
            | decode,
        ],
    }


def test_closed_sets_load_as_enum_members() -> None:
    c = ClusterConfig.from_dict(_file("/ckpt/m", dtype="bfloat16"))
    d = c.node("d0")
    assert d.role is Role.DECODE and d.kv_transport is KvTransport.RDMA and d.dtype is Dtype.BFLOAT16
    assert d.kv_load_failure_policy is KvLoadFailurePolicy.REPREFILL
    p = c.node("p0")
    assert p.kv_transport is KvTransport.TCP and p.kv_load_failure_policy is KvLoadFailurePolicy.RECOMPUTE
    assert p.role.moves_kv and not p.role.decodes and d.role.decodes


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("kv_transport", "udp", "d0.*kv_transport.*'tcp', 'rdma' or 'cuda_ipc'"),
        ("kv_load_failure_policy", "retry", "'fail', 'recompute' or 'reprefill'"),
        ("dtype", "int8", "'auto', 'float32', 'bfloat16' or 'float16'"),
    ],
)
def test_a_value_outside_a_closed_set_is_refused_at_load(key: str, value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ClusterConfig.from_dict(_file("/ckpt/m", **{key: value}))


def test_transfer_timeouts_are_settings_of_the_side_that_waits() -> None:
    c = ClusterConfig.from_dict(_file("/ckpt/m", kv_pull_timeout_s=7.5))
    assert c.node("d0").kv_pull_timeout_s == 7.5 and c.node("p0").kv_ready_timeout_s == 60.0
    with pytest.raises(
        ConfigError, match="kv_ready_timeout_s acts on prefill nodes only, not on role decode"
    ):
        ClusterConfig.from_dict(_file("/ckpt/m", kv_ready_timeout_s=5.0))


def test_start_resolves_the_model_and_this_hosts_addresses(tmp_path: Path) -> None:
    c = ClusterConfig.from_dict(_file(str(tmp_path)))
    d = NodeSpec.start(
        resolve_node_settings(c, "d0", is_multimodal=_text), env={"PDSERVE_KV_HOST": "10.9.9.9"}
    )
    # a DNS name: every interface, the KV address from the environment, the file's host advertised
    assert (d.host, d.kv_host, d.advertise_address) == ("0.0.0.0", "10.9.9.9", "decode.svc.local:5003")
    assert d.engine.model == str(tmp_path) and d.engine.scheduler.max_num_batched_tokens == 2048
    assert d.kv_transport is KvTransport.RDMA and d.kv_load_failure_policy is KvLoadFailurePolicy.REPREFILL
    assert d.kv_keepalive_s == 4.0  # the prefill lease / 3
    assert d.shared_token == "t0k" and d.stages == 1 and not d.ec_consumer and not d.colocated_encoder
    p = NodeSpec.start(resolve_node_settings(c, "p0", is_multimodal=_text), advertise_host="10.1.1.1", env={})
    assert (p.host, p.kv_host, p.advertise_address) == ("10.0.0.5", "10.0.0.5", "10.1.1.1:5001")
    assert p.engine.scheduler.max_num_batched_tokens == 16384 and p.kv_lease_s == 12.0
    bound = NodeSpec.start(resolve_node_settings(c, "p0", is_multimodal=_text), bind_host="127.0.0.2")
    assert bound.host == "127.0.0.2"


def test_start_names_a_missing_model() -> None:
    c = ClusterConfig.from_dict(_file("/no/such/ckpt"))
    with pytest.raises(ConfigError, match=r"/no/such/ckpt.*does not exist"):
        NodeSpec.start(resolve_node_settings(c, "d0", is_multimodal=_text))


def test_for_test_builds_a_node_of_a_checked_file() -> None:
    engine = EngineConfig(model="/ckpt/m", parallel=ParallelConfig(pipeline_parallel_size=2))
    p = NodeSpec.for_test("p-0", "prefill", engine, grpc_port=6001, kv_checksum=True, is_multimodal=_text)
    assert p.role is Role.PREFILL and p.engine is engine and p.node.pp == 2 and p.stages == 2
    assert p.kv_checksum and p.grpc_port == 6001 and p.advertise_address == "127.0.0.1:6001"
    assert [n.role for n in p.cluster.nodes] == [Role.PREFILL, Role.DECODE]  # the file needs a decode node
    c = NodeSpec.for_test("c-0", Role.COLOCATED, EngineConfig(model="/ckpt/m"), is_multimodal=_text)
    assert len(c.cluster.nodes) == 1 and c.frontend_port == 0
    with pytest.raises(ConfigError, match="kv_transport"):
        NodeSpec.for_test(
            "d-0", "decode", EngineConfig(model="/ckpt/m"), kv_transport="udp", is_multimodal=_text
        )
