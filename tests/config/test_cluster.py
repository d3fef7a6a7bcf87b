"""Cluster config loading and validation, and the derived-settings resolver. Pure Python, no files
beyond tmp_path, no checkpoints (``is_multimodal`` is injected)."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path
from typing import Any

import pytest

from pdserve.config.choices import EcRole, KvRole, Role
from pdserve.config.cluster import (
    KV_ROLE_OF_ROLE,
    ClusterConfig,
    UnknownNodeError,
    default_local_cluster,
    load_cluster_config,
    write_cluster_config,
)
from pdserve.config.engine import EngineConfig
from pdserve.config.resolver import checkpoint_is_multimodal, resolve_node_settings
from pdserve.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]

YAML_1P1D = """
model: /ckpt/tiny-llama
router: {host: 127.0.0.1, port: 8000, policy: round_robin}
nodes:
  - {name: prefill-0, role: prefill, grpc_port: 50061, metrics_port: 9101}
  - {name: decode-0, role: decode, grpc_port: 50062, metrics_port: 9102, kv_role: kv_consumer}
"""

TOML_1P1D = """
model = "/ckpt/tiny-llama"
served_model_name = "tiny"

[router]
port = 8000
local_prefill_max_tokens = 0

[[nodes]]
name = "prefill-0"
role = "prefill"
grpc_port = 50061
metrics_port = 9101
pp = 2

[[nodes]]
name = "decode-0"
role = "decode"
grpc_port = 50062
metrics_port = 9102
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def _node(name: str, role: str, port: int, **kw: Any) -> dict[str, Any]:
    return {"name": name, "role": role, "grpc_port": port, "metrics_port": port + 1000, **kw}


def _cluster(*nodes: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"model": "/ckpt/m", **top, "nodes": list(nodes)}


def _1p1d(**prefill_kw: Any) -> dict[str, Any]:
    return _cluster(_node("p0", "prefill", 50061, **prefill_kw), _node("d0", "decode", 50062))


def _load_error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as ei:
        ClusterConfig.from_dict(data)
    return str(ei.value)


# -- parsing --------------------------------------------------------------------------------------


def test_yaml_parses_with_defaults_and_helpers(tmp_path: Path) -> None:
    c = load_cluster_config(_write(tmp_path, "c.yaml", YAML_1P1D))
    assert c.router.policy == "round_robin" and c.router.local_prefill_max_tokens == 32
    assert [n.name for n in c.prefill_nodes] == ["prefill-0"]
    assert [n.name for n in c.decode_nodes] == ["decode-0"] and c.encoder_nodes == ()
    p = c.node("prefill-0")
    assert p.model == "/ckpt/tiny-llama"  # filled from the top-level default
    assert p.grpc_address == "127.0.0.1:50061" and p.kv_role is None and p.block_size == 16
    assert c.served_name(p.model) == "tiny-llama"  # folder name by default


def test_toml_parses(tmp_path: Path) -> None:
    c = load_cluster_config(_write(tmp_path, "c.toml", TOML_1P1D))
    assert c.node("prefill-0").pp == 2 and c.router.local_prefill_max_tokens == 0
    assert c.served_name("/ckpt/tiny-llama") == "tiny"


def test_yaml_and_toml_agree(tmp_path: Path) -> None:
    y = YAML_1P1D.replace("policy: round_robin", "local_prefill_max_tokens: 0")
    y = y.replace("kv_role: kv_consumer", "kv_role: null")
    y = y.replace("metrics_port: 9101}", "metrics_port: 9101, pp: 2}")
    y = "served_model_name: tiny\n" + y
    assert load_cluster_config(_write(tmp_path, "a.yml", y)) == load_cluster_config(
        _write(tmp_path, "a.toml", TOML_1P1D)
    )


def test_node_model_overrides_default() -> None:
    c = ClusterConfig.from_dict(
        _cluster(
            _node("p0", "prefill", 1000),
            _node("d0", "decode", 1001),
            _node("c0", "colocated", 1002, model="/ckpt/other"),
        )
    )
    assert c.node("c0").model == "/ckpt/other" and c.models == ("/ckpt/m", "/ckpt/other")


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("c.json", "{}", "use .yaml, .yml or .toml"),
        ("c.yaml", "nodes: [", "not valid YAML"),
        ("c.toml", "nodes = [", "not valid TOML"),
        ("c.yaml", "- a\n- b\n", "expected a mapping"),
    ],
)
def test_bad_files(tmp_path: Path, name: str, text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_cluster_config(_write(tmp_path, name, text))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read cluster config"):
        load_cluster_config(tmp_path / "nope.yaml")


def test_env_expansion(tmp_path: Path) -> None:
    p = _write(tmp_path, "c.yaml", YAML_1P1D + "shared_token: ${TOKEN}\n")
    assert load_cluster_config(p, env={"TOKEN": "s3cret"}).shared_token == "s3cret"
    with pytest.raises(ConfigError, match=r"\$\{TOKEN\}, which is not set"):
        load_cluster_config(p, env={})


def test_write_round_trip(tmp_path: Path) -> None:
    c = load_cluster_config(_write(tmp_path, "c.yaml", YAML_1P1D))
    again = load_cluster_config(write_cluster_config(c, tmp_path / "out.yaml"))
    assert again == c
    assert "accept_mm_embeds" not in again.node("decode-0").model_fields_set  # stays derived


# -- misconfigurations ----------------------------------------------------------------------------


def test_extra_field_is_rejected_naming_it() -> None:
    msg = _load_error(_1p1d(grpc_prot=1))
    assert "unknown field 'grpc_prot'" in msg and "nodes[0] ('p0')" in msg and "'grpc_port'" in msg
    assert "unknown field 'polcy' in router" in _load_error({**_1p1d(), "router": {"polcy": "x"}})
    assert "unknown field 'modle' in top level" in _load_error({**_1p1d(), "modle": "/x"})


def test_no_decode_capable_node() -> None:
    msg = _load_error(_cluster(_node("p0", "prefill", 1000)))
    assert "no decode-capable node" in msg and "decode or colocated" in msg


def test_model_served_by_no_node() -> None:
    data = _cluster(
        _node("p0", "prefill", 1000, model="/a"), _node("d0", "decode", 1001, model="/a"), model="/unused"
    )
    assert "model '/unused' is served by no node" in _load_error(data)


def test_model_without_decode_node() -> None:
    data = _cluster(_node("d0", "decode", 1000), _node("p1", "prefill", 1001, model="/other"))
    msg = _load_error(data)
    assert "'/other' is served by no decode-capable node" in msg and "p1" in msg


def test_missing_model() -> None:
    data = {"nodes": [_node("p0", "prefill", 1000), _node("d0", "decode", 1001)]}
    msg = _load_error(data)
    assert "has no model" in msg and "'p0'" in msg and "top-level `model`" in msg


def test_duplicate_node_names() -> None:
    data = _cluster(_node("n", "prefill", 1000), _node("n", "decode", 1001))
    assert "duplicate node names ['n']" in _load_error(data)


@pytest.mark.parametrize(
    ("d0_kw", "router", "clash"),
    [
        ({"grpc_port": 1000}, {}, "p0.grpc_port and d0.grpc_port"),
        ({"metrics_port": 1000}, {}, "p0.grpc_port and d0.metrics_port"),
        ({"grpc_port": 8000}, {}, "router.port and d0.grpc_port"),
        ({"host": "localhost"}, {"port": 1001}, "router.port and d0.grpc_port"),
    ],
)
def test_duplicate_host_port(d0_kw: dict[str, Any], router: dict[str, Any], clash: str) -> None:
    data = _cluster(_node("p0", "prefill", 1000), {**_node("d0", "decode", 1001), **d0_kw}, router=router)
    msg = _load_error(data)
    assert clash in msg and "distinct port" in msg


def test_same_port_on_different_hosts_is_fine() -> None:
    data = _cluster(_node("p0", "prefill", 1000, host="a"), _node("d0", "decode", 1000, host="b"))
    assert len(ClusterConfig.from_dict(data).nodes) == 2


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"kv_role": "kv_consumer"}, "role prefill contradicts kv_role kv_consumer"),
        ({"ec_role": "ec_producer"}, "only encoder nodes produce embeddings"),
        ({"tp": 0}, "tp must be >= 1"),
        ({"pp": -1}, "pp must be >= 1"),
        ({"block_size": 12}, "power of two"),
        ({"device": "gpu"}, "device must be"),
        ({"dtype": "fp8"}, "dtype"),
        ({"cpu_threads": 0}, "cpu_threads"),
    ],
)
def test_bad_node_fields(kw: dict[str, Any], needle: str) -> None:
    msg = _load_error(_1p1d(**kw))
    assert needle in msg and "p0" in msg


def test_decode_nodes_serve_a_steps_socket() -> None:
    c = ClusterConfig.from_dict(_1p1d())
    assert c.node("d0").steps_port() == 0  # default: a Steps socket, any free port
    assert c.node("p0").steps_port() is None  # prefill serves no Steps streams
    both = _cluster(_node("p0", "prefill", 50061), _node("d0", "decode", 50062, frontend_port=50070))
    assert ClusterConfig.from_dict(both).node("d0").steps_port() == 50070


@pytest.mark.parametrize(
    ("prefill_kw", "decode_kw", "needle"),
    [
        ({"frontend_port": 50070}, {}, "frontend_port act on the Steps socket"),
        ({}, {"frontend_port": 50062}, "d0.frontend_port"),
    ],
)
def test_bad_steps_socket_settings_are_refused(
    prefill_kw: dict[str, Any], decode_kw: dict[str, Any], needle: str
) -> None:
    msg = _load_error(
        _cluster(_node("p0", "prefill", 50061, **prefill_kw), _node("d0", "decode", 50062, **decode_kw))
    )
    assert needle in msg


@pytest.mark.parametrize("value", ["socket", "process", "inline"])
def test_the_removed_frontend_is_refused_naming_what_the_node_does_now(value: str) -> None:
    msg = _load_error(_cluster(_node("p0", "prefill", 50061), _node("d0", "decode", 50062, frontend=value)))
    assert f"nodes[1] ('d0'): frontend ('{value}') was removed" in msg
    assert "their own Steps socket" in msg and "delete it" in msg


def test_the_removed_decode_stream_is_refused_at_load() -> None:
    msg = _load_error({**_1p1d(), "router": {"decode_stream": "per_request"}})
    assert "router: decode_stream ('per_request') was removed" in msg and "Steps socket" in msg


def test_block_size_must_match_between_kv_peers() -> None:
    msg = _load_error(_1p1d(block_size=32))
    assert "must share block_size" in msg and "'p0': 32" in msg


def test_prefill_timeout_within_request_timeout() -> None:
    data = {**_1p1d(), "router": {"request_timeout_s": 10, "prefill_timeout_s": 20}}
    assert "exceeds router.request_timeout_s" in _load_error(data)


def test_prefill_timeout_default_is_the_prefill_first_token_deadline() -> None:
    c = ClusterConfig.from_dict(_1p1d())
    assert c.router.prefill_timeout_s == 30.0  # not 120: a wedged prefill must not cost 2 minutes
    assert c.router.prefill_timeout_s <= c.router.decode_first_token_timeout_s


def test_test_only_faults_are_off_by_default_and_refused_where_they_cannot_act() -> None:
    c = ClusterConfig.from_dict(_1p1d(faults={"push_delay_s": 1.5, "engine_death_on_sigusr1": True}))
    p = c.node("p0")
    assert p.faults.push_delay_s == 1.5 and p.faults.engine_death_on_sigusr1
    assert c.node("d0").faults.push_delay_s == 0 and not c.node("d0").faults.engine_death_on_sigusr1
    data = _1p1d()
    data["nodes"][1]["faults"] = {"prefill_reply_delay_s": 2.0}
    msg = _load_error(data)
    assert "d0" in msg and "prefill nodes only" in msg and "decode" in msg
    assert "faults" in _load_error(_1p1d(faults={"no_such_fault": 1}))


def test_unknown_node_names_the_known_ones() -> None:
    c = ClusterConfig.from_dict(_1p1d())
    with pytest.raises(UnknownNodeError) as ei:
        c.node("nope")
    assert isinstance(ei.value, KeyError) and isinstance(ei.value, ConfigError)
    assert str(ei.value) == "no node named 'nope' in the cluster config; known nodes: ['p0', 'd0']"


# -- default local cluster and the example files --------------------------------------------------


def test_default_local_cluster_ports() -> None:
    c = default_local_cluster("/ckpt/tiny", base_port=9000)
    assert c.router.port == 9000
    assert [(n.name, n.role, n.grpc_port, n.metrics_port) for n in c.nodes] == [
        ("prefill-0", "prefill", 9001, 9002),
        ("decode-0", "decode", 9003, 9004),
    ]
    with pytest.raises(ConfigError, match="base_port"):
        default_local_cluster("/ckpt/tiny", base_port=65534)


def test_local_example_is_the_default_local_cluster() -> None:
    c = load_cluster_config(REPO / "deploy/configs/local.yaml")
    assert c == default_local_cluster("models/tiny-llama", 8000, served_model_name="tiny-llama")


def test_k8s_example_loads() -> None:
    env = {"PDSERVE_API_KEY": "k", "PDSERVE_SHARED_TOKEN": "t"}
    c = load_cluster_config(REPO / "deploy/configs/1p1d-k8s.yaml", env=env)
    assert c.node("decode-0").grpc_address == "pdserve-decode:50061"
    assert c.redis_url == "redis://pdserve-redis.pdserve:6379/0" and c.registry_ttl_s == 10
    assert c.shared_token == "t" and c.router.api_key == "k"


# -- resolver -------------------------------------------------------------------------------------


def _text(model: str) -> bool:
    return False


def _vlm(model: str) -> bool:
    return True


def _epd(**prefill_kw: Any) -> ClusterConfig:
    data = _cluster(
        _node("e0", "encoder", 1000),
        _node("p0", "prefill", 1001, **prefill_kw),
        _node("d0", "decode", 1002),
        _node("c0", "colocated", 1003),
    )
    return ClusterConfig.from_dict({**data, "redis_url": "redis://127.0.0.1:6379/0"})


def test_encoder_needs_redis_and_one_device() -> None:
    data = _cluster(_node("e0", "encoder", 1000), _node("d0", "decode", 1002))
    with pytest.raises(ConfigError, match="need redis_url"):
        ClusterConfig.from_dict(data)
    data["redis_url"] = "redis://127.0.0.1:6379/0"
    ClusterConfig.from_dict(data)
    for bad, needle in (({"tp": 2}, "one device"), ({"kv_transport": "cuda_ipc"}, "not cuda_ipc")):
        d = {**data, "nodes": [{**data["nodes"][0], **bad}, data["nodes"][1]]}
        with pytest.raises(ConfigError, match=needle):
            ClusterConfig.from_dict(d)
    d = {**data, "nodes": [data["nodes"][0], {**data["nodes"][1], "max_image_pixels": 10}]}
    with pytest.raises(ConfigError, match="max_image_pixels is a setting of the node that decodes images"):
        ClusterConfig.from_dict(d)


@pytest.mark.parametrize(
    ("node", "kv_role"), [("p0", "kv_producer"), ("d0", "kv_consumer"), ("c0", "kv_both")]
)
def test_kv_role_restating_the_role_is_accepted_and_changes_nothing(node: str, kv_role: str) -> None:
    roles = {"p0": "prefill", "d0": "decode", "c0": "colocated"}
    ports = {"p0": 1001, "d0": 1002, "c0": 1003}

    def cluster(restate: bool) -> ClusterConfig:
        extra = {"kv_role": kv_role} if restate else {}
        return ClusterConfig.from_dict(
            _cluster(*(_node(n, roles[n], ports[n], **(extra if n == node else {})) for n in roles))
        )

    omitted, restated = cluster(False), cluster(True)
    assert omitted.node(node).kv_role is None and restated.node(node).kv_role == KvRole(kv_role)
    assert KV_ROLE_OF_ROLE[Role(roles[node])] is KvRole(kv_role)
    r = resolve_node_settings(restated, node, is_multimodal=_text)
    assert (
        r.node.model_copy(update={"kv_role": None})
        == resolve_node_settings(omitted, node, is_multimodal=_text).node
    )
    assert r.ec_role is None and r.overridden == ()
    assert not r.accept_mm_embeds and not r.allow_missing_mm_embeds


def test_encoder_of_text_model_is_an_error() -> None:
    with pytest.raises(ConfigError, match="encoder but model '/ckpt/m' has no vision tower"):
        resolve_node_settings(_epd(), "e0", is_multimodal=_text)


@pytest.mark.parametrize(
    ("node", "role", "ec_role", "mm"),
    [
        ("e0", "encoder", "ec_producer", False),
        ("p0", "prefill", "ec_consumer", True),  # EC consumer
        ("d0", "decode", None, True),  # KV consumer of a multimodal model
        ("c0", "colocated", "ec_consumer", True),
    ],
)
def test_roles_and_mm_flags_derived_multimodal(node: str, role: str, ec_role: str, mm: bool) -> None:
    r = resolve_node_settings(_epd(), node, is_multimodal=_vlm)
    assert (r.role, r.ec_role) == (Role(role), ec_role and EcRole(ec_role))
    assert r.accept_mm_embeds is mm and r.allow_missing_mm_embeds is mm and r.is_multimodal


def test_prefill_of_vlm_without_encoder_is_not_ec_consumer() -> None:
    c = ClusterConfig.from_dict(_1p1d())
    p = resolve_node_settings(c, "p0", is_multimodal=_vlm)
    assert p.ec_role is None and not p.accept_mm_embeds  # computes its own embeddings
    assert resolve_node_settings(c, "d0", is_multimodal=_vlm).allow_missing_mm_embeds


def test_hand_set_accept_mm_embeds_true_is_kept(caplog: pytest.LogCaptureFixture) -> None:
    c = ClusterConfig.from_dict(_1p1d(accept_mm_embeds=True))
    with caplog.at_level(logging.WARNING, logger="pdserve.config.resolver"):
        r = resolve_node_settings(c, "p0", is_multimodal=_text)
    assert r.accept_mm_embeds and not r.allow_missing_mm_embeds  # never turned off
    assert caplog.records == [] and r.overridden == ()


def test_hand_set_false_on_ec_consumer_is_turned_on_with_warning(caplog: pytest.LogCaptureFixture) -> None:
    c = _epd(accept_mm_embeds=False)
    with caplog.at_level(logging.WARNING, logger="pdserve.config.resolver"):
        r = resolve_node_settings(c, "p0", is_multimodal=_vlm)
    assert r.ec_role == "ec_consumer" and r.accept_mm_embeds and r.allow_missing_mm_embeds
    assert r.overridden == ("accept_mm_embeds",)
    (rec,) = caplog.records
    msg = rec.getMessage()
    assert "p0" in msg and "accept_mm_embeds" in msg and "False" in msg and "True" in msg


def test_hand_set_roles_and_flags_are_overwritten(caplog: pytest.LogCaptureFixture) -> None:
    c = ClusterConfig.from_dict(
        _cluster(
            _node("p0", "prefill", 1000, ec_role="ec_consumer", allow_missing_mm_embeds=True),
            _node("d0", "decode", 1001),
        )
    )
    with caplog.at_level(logging.WARNING, logger="pdserve.config.resolver"):
        r = resolve_node_settings(c, "p0", is_multimodal=_text)
    assert r.ec_role is None and not r.allow_missing_mm_embeds  # no encoder, text model
    assert r.overridden == ("ec_role", "allow_missing_mm_embeds") and len(caplog.records) == 2
    assert c.node("p0").ec_role == "ec_consumer"  # the cluster config itself is untouched


def test_resolve_unknown_node() -> None:
    with pytest.raises(UnknownNodeError, match="known nodes"):
        resolve_node_settings(ClusterConfig.from_dict(_1p1d()), "x", is_multimodal=_text)


def test_engine_config_mapping() -> None:
    c = ClusterConfig.from_dict(
        _1p1d(
            dtype="bfloat16",
            device="cuda:1",
            max_model_len=4096,
            kv_cache_memory_bytes=1 << 30,
            max_num_seqs=8,
            max_num_batched_tokens=512,
            pp=2,
            cpu_threads=3,
        )
    )
    r = resolve_node_settings(c, "p0", is_multimodal=_text)
    e = r.engine_config(pipeline_rank=1)
    assert isinstance(e, EngineConfig)
    assert (e.model, e.dtype, e.device, e.max_model_len) == ("/ckpt/m", "bfloat16", "cuda:1", 4096)
    assert (e.cache.block_size, e.cache.kv_cache_memory_bytes) == (16, 1 << 30)
    assert (e.scheduler.max_num_seqs, e.scheduler.max_num_batched_tokens) == (8, 512)
    assert (e.parallel.pipeline_parallel_size, e.parallel.pipeline_rank) == (2, 1)
    assert e.cpu_threads == 3
    assert r.served_model_name == "m"


def test_cpu_threads_auto_leaves_half_the_cores_and_a_set_value_wins(monkeypatch) -> None:
    """EngineConfig.cpu_threads: auto is half the usable cores on a CPU device, split between
    the engine's processes, at least one; torch's default (None) on other devices; a set value
    is taken as it is on any device; below one is refused naming the value."""
    from pdserve.config import engine as engine_config

    monkeypatch.setattr(engine_config, "usable_cpus", lambda: 16)
    auto = EngineConfig(model="/m")
    assert auto.intra_op_threads(cpu_device=True) == 8
    assert auto.intra_op_threads(cpu_device=True, processes=2) == 4
    assert auto.intra_op_threads(cpu_device=True, processes=32) == 1
    assert auto.intra_op_threads(cpu_device=False) is None
    assert EngineConfig(model="/m", cpu_threads=3).intra_op_threads(cpu_device=False) == 3
    monkeypatch.setattr(engine_config, "usable_cpus", lambda: 2)
    assert auto.intra_op_threads(cpu_device=True) == 1
    with pytest.raises(ConfigError, match=r"cpu_threads must be >= 1.*got 0"):
        EngineConfig(model="/m", cpu_threads=0)


def test_checkpoint_is_multimodal(tmp_path: Path) -> None:
    cases = {
        "llama": {"architectures": ["LlamaForCausalLM"]},
        "llava": {"architectures": ["LlavaForConditionalGeneration"]},
        "qwen2vl": {"architectures": ["Qwen2VLForConditionalGeneration"]},
        "vision": {"architectures": ["Foo"], "vision_config": {}},
    }
    for name, cfg in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    got = {name: checkpoint_is_multimodal(str(tmp_path / name)) for name in cases}
    assert got == {"llama": False, "llava": True, "qwen2vl": True, "vision": True}
    with pytest.raises(ConfigError, match="does not exist"):
        checkpoint_is_multimodal(str(tmp_path / "missing"))


def test_keepalive_must_beat_the_lease(tmp_path) -> None:
    import pytest

    from pdserve.config.cluster import ClusterConfig, default_local_cluster
    from pdserve.errors import ConfigError

    data = default_local_cluster(tmp_path).model_dump(mode="json", exclude_unset=True)
    data["nodes"][0]["kv_lease_s"] = 4.0
    data["nodes"][1]["kv_keepalive_s"] = 4.0
    with pytest.raises(ConfigError, match="kv_keepalive_s"):
        ClusterConfig.from_dict(data)
    data["nodes"][1]["kv_keepalive_s"] = 1.0
    c = ClusterConfig.from_dict(data)
    assert c.keepalive_s(c.node("decode-0")) == 1.0
    del data["nodes"][1]["kv_keepalive_s"]  # derived: a third of the shortest lease, at most 5 s
    c = ClusterConfig.from_dict(data)
    assert c.keepalive_s(c.node("decode-0")) == 4.0 / 3


def test_encoder_faults_act_on_encoder_nodes_only() -> None:
    data = _cluster(_node("e0", "encoder", 1000), _node("d0", "decode", 1002))
    data["redis_url"] = "redis://127.0.0.1:6379/0"
    data["nodes"][0]["faults"] = {"encode_delay_s": 1.0, "ec_push_delay_s": 0.5}
    e = ClusterConfig.from_dict(data).node("e0")
    assert e.faults.encode_delay_s == 1.0 and e.faults.ec_push_delay_s == 0.5
    for fault in ("encode_delay_s", "ec_push_delay_s"):
        d = {**data, "nodes": [data["nodes"][0], {**data["nodes"][1], "faults": {fault: 1.0}}]}
        with pytest.raises(ConfigError, match="encoder nodes only, not on role decode"):
            ClusterConfig.from_dict(d)


def test_token_budget_is_derived_from_the_role_unless_the_file_sets_it() -> None:
    from pdserve.config.cluster import DEFAULT_MAX_NUM_BATCHED_TOKENS, PREFILL_MAX_NUM_BATCHED_TOKENS

    c = ClusterConfig.from_dict(
        _cluster(_node("p0", "prefill", 50061), _node("d0", "decode", 50062), _node("c0", "colocated", 50063))
    )
    assert c.node("p0").max_num_batched_tokens is None  # the file said nothing
    budgets = {
        name: resolve_node_settings(c, name, is_multimodal=_text)
        .engine_config()
        .scheduler.max_num_batched_tokens
        for name in ("p0", "d0", "c0")
    }
    assert budgets == {
        "p0": PREFILL_MAX_NUM_BATCHED_TOKENS,
        "d0": DEFAULT_MAX_NUM_BATCHED_TOKENS,
        "c0": DEFAULT_MAX_NUM_BATCHED_TOKENS,
    }
    assert PREFILL_MAX_NUM_BATCHED_TOKENS > DEFAULT_MAX_NUM_BATCHED_TOKENS
    r = resolve_node_settings(c, "p0", is_multimodal=_text)
    assert r.node.max_num_batched_tokens == r.max_num_batched_tokens == PREFILL_MAX_NUM_BATCHED_TOKENS
    assert r.overridden == ()  # a default filled in, nothing hand-set replaced
    # a value written in the file is the user's: kept for every role, prefill too
    set_ = ClusterConfig.from_dict(_1p1d(max_num_batched_tokens=1024))
    r = resolve_node_settings(set_, "p0", is_multimodal=_text)
    assert r.engine_config().scheduler.max_num_batched_tokens == 1024 and r.overridden == ()


def test_metrics_require_token_needs_a_shared_token() -> None:
    assert "needs shared_token" in _load_error({**_1p1d(), "metrics_require_token": True})
    c = ClusterConfig.from_dict({**_1p1d(), "metrics_require_token": True, "shared_token": "t"})
    assert c.metrics_require_token and not c.allow_unauthenticated_kv_ports


def test_steps_socket_settings_only_where_a_steps_socket_listens() -> None:
    msg = _load_error(_1p1d(steps_hello_timeout_s=0.5))
    assert "steps_hello_timeout_s" in msg and "prefill" in msg
    assert "steps_max_pending_per_peer" in _load_error(_1p1d(steps_max_pending_per_peer=2))
    d0 = _node("d0", "decode", 50062, steps_hello_timeout_s=0.5, steps_max_pending_per_peer=2)
    node = ClusterConfig.from_dict(_cluster(d0)).node("d0")
    assert (node.steps_hello_timeout_s, node.steps_max_pending_per_peer) == (0.5, 2)
    assert ClusterConfig.from_dict(_1p1d()).node("d0").steps_hello_timeout_s == 1.0
