"""The cluster config file: every node of one deployment, its address, model, sizes and roles.

One file (YAML or TOML, chosen by extension) describes the whole deployment; each node reads
its own entry, the router reads all of them. Settings that follow from the roles
(``ec_role``, ``accept_mm_embeds``, ``allow_missing_mm_embeds``) are derived by :func:`pdserve.config.resolver.resolve_node_settings`, not here.

Everything that can be checked without the checkpoint is checked at load, and every problem
is a :class:`~pdserve.errors.ConfigError` that names the field and the fix.

This module holds :class:`ClusterConfig` (the whole file, with the checks across nodes) and
re-exports the rest, so ``pdserve.config.cluster`` stays the one import for callers:

    router_settings.py  RouterConfig (the ``router`` section)
    node_settings.py    NodeConfig, FaultsConfig and the per-role constants
    choices.py          the enums of every closed set of values (Role, KvTransport, ...)
    cluster_file.py     load_cluster_config, write_cluster_config, default_local_cluster,
                        and the wording of validation errors
    frozen.py           _Frozen, the base of every model
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from pdserve.config.choices import EcRole, KvRole, KvTransport, Role
from pdserve.config.cluster_file import (
    _describe_error,
    default_local_cluster,
    load_cluster_config,
    write_cluster_config,
)
from pdserve.config.frozen import _Frozen
from pdserve.config.kv_events_settings import KVEventsSettings
from pdserve.config.lora_settings import LoRASettings
from pdserve.config.node_settings import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    KV_ROLE_OF_ROLE,
    PREFILL_MAX_NUM_BATCHED_TOKENS,
    FaultsConfig,
    NodeConfig,
)
from pdserve.config.router_settings import RouterConfig
from pdserve.errors import ConfigError
from pdserve.models.resolve import looks_like_hf_id

# The public names. All but ClusterConfig and UnknownNodeError are re-exported from the modules
# above: callers (resolver, launcher, services, tests, bench) import them from here.
__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "KV_ROLE_OF_ROLE",
    "PREFILL_MAX_NUM_BATCHED_TOKENS",
    "ClusterConfig",
    "EcRole",
    "FaultsConfig",
    "KvRole",
    "KvTransport",
    "NodeConfig",
    "Role",
    "RouterConfig",
    "UnknownNodeError",
    "default_local_cluster",
    "load_cluster_config",
    "write_cluster_config",
]


class UnknownNodeError(ConfigError, KeyError):
    """``ClusterConfig.node(name)`` for a name the file does not list."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class ClusterConfig(_Frozen):
    model: str | None = None  # default checkpoint of every node that does not name its own
    served_model_name: str | None = None  # name of `model` in the API; default: its folder name
    router: RouterConfig = RouterConfig()  # frozen, so one shared default is safe
    redis_url: str | None = None  # node registry / embedding-cache index
    shared_token: str | None = None  # internal gRPC calls carry "authorization: Bearer <token>"
    # Every node's /metrics answers only "Authorization: Bearer <shared_token>" (401 otherwise).
    metrics_require_token: bool = False
    # Mooncake (kv_transport tcp / rdma) listens on every interface with no authentication
    # (pdserve/kvtransfer/exposure.py): a node on a non-loopback address refuses to start unless
    # this says the operator keeps those ports off the network (firewall, NetworkPolicy).
    allow_unauthenticated_kv_ports: bool = False
    # Redis registry: a node's entry expires this long after its last heartbeat (beats every TTL/3).
    registry_ttl_s: float = Field(default=10.0, gt=0)
    lora: LoRASettings | None = None  # LoRA adapters every node serves (None: the base model only)
    kv_events: KVEventsSettings = KVEventsSettings()  # KV event publishing / following (redis_url)
    nodes: tuple[NodeConfig, ...]

    @model_validator(mode="after")
    def _check_lora(self) -> ClusterConfig:
        if self.lora is not None and self.router.workers > 1:
            raise ConfigError(
                f"lora with router.workers={self.router.workers}: the adapter registry lives in one router "
                "process (load / unload answer there); use router.workers: 1"
            )
        split = [f"{n.name} (tp={n.tp}, pp={n.pp})" for n in self.nodes if n.tp > 1 or n.pp > 1]
        if self.lora is not None and split:
            raise ConfigError(
                f"lora on nodes {', '.join(split)}: adapters are applied by the node's own process only "
                "(TP ranks and pipeline stages hold no adapter slots); serve adapters with tp: 1 and pp: 1"
            )
        return self

    @model_validator(mode="after")
    def _check_registry(self) -> ClusterConfig:
        if "registry_ttl_s" in self.model_fields_set and not self.redis_url:
            raise ConfigError(
                f"registry_ttl_s ({self.registry_ttl_s}) is set but redis_url is not: the TTL is the "
                "Redis registry's; set redis_url or remove registry_ttl_s (the static node list has none)"
            )
        if self.router.policy == "cache_aware" and not self.redis_url:
            raise ConfigError(
                "router.policy cache_aware needs redis_url: the nodes publish their KV events there; "
                "set redis_url or choose least_loaded, prefix_affinity or round_robin"
            )
        if "kv_events" in self.model_fields_set and not self.redis_url:
            raise ConfigError(
                "kv_events is set but redis_url is not: KV events go through Redis streams; "
                "set redis_url or remove kv_events"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _fill_node_models(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or not isinstance(data.get("nodes"), list | tuple):
            return data  # pydantic reports the shape error
        default = data.get("model")
        nodes = []
        for i, node in enumerate(data["nodes"]):
            if isinstance(node, Mapping) and node.get("model") is None:
                if default is None:
                    raise ConfigError(
                        f"nodes[{i}] ({node.get('name', '?')!r}) has no model: set the top-level "
                        "`model` (the default of every node) or the node's own `model`"
                    )
                node = {**node, "model": default}
            nodes.append(node)
        return {**data, "nodes": nodes}

    @model_validator(mode="after")
    def _check_cluster(self) -> ClusterConfig:
        names = [n.name for n in self.nodes]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ConfigError(f"duplicate node names {dups}: every node needs its own name")
        if not any(n.role.decodes for n in self.nodes):
            raise ConfigError(
                "no decode-capable node: add a node with role decode or colocated "
                "(a prefill node hands its KV to one; without it no request can finish)"
            )
        if self.metrics_require_token and not self.shared_token:
            raise ConfigError(
                "metrics_require_token: true needs shared_token (the bearer token /metrics asks "
                "for): set shared_token or drop metrics_require_token"
            )
        self._check_models()
        self._check_addresses()
        self._check_encoders()
        self._check_keepalive()
        return self

    def keepalive_s(self, node: NodeConfig) -> float:
        """A decode node's KeepAlive period: as set, else min(5 s, the shortest prefill lease / 3)."""
        if node.kv_keepalive_s is not None:
            return node.kv_keepalive_s
        leases = [n.kv_lease_s for n in self.nodes if n.role is Role.PREFILL]
        return min([5.0] + [lease / 3 for lease in leases])

    def _check_keepalive(self) -> None:
        """Decode's KeepAlive must come more often than any prefill lease runs out."""
        leases = [n.kv_lease_s for n in self.nodes if n.role is Role.PREFILL]
        for n in self.nodes:
            if (
                n.role is Role.DECODE
                and leases
                and n.kv_keepalive_s is not None
                and n.kv_keepalive_s >= min(leases)
            ):
                raise ConfigError(
                    f"node {n.name!r}: kv_keepalive_s ({n.kv_keepalive_s}) must be below the shortest "
                    f"prefill kv_lease_s ({min(leases)}), or queued requests lose their KV; lower it"
                )

    def _check_encoders(self) -> None:
        """The embedding-cache index lives in Redis (docs/design.md §3): an encoder needs redis_url."""
        if self.encoder_nodes and not self.redis_url:
            names = [n.name for n in self.encoder_nodes]
            raise ConfigError(
                f"encoder nodes {names} need redis_url: the embedding-cache index (key -> owner, "
                "address, shape, expiry) lives in Redis; set redis_url or remove the encoder nodes"
            )
        for n in self.nodes:
            if (
                n.role is not Role.ENCODER
                and n.kv_transport is KvTransport.CUDA_IPC
                and any(e.model == n.model for e in self.encoder_nodes)
            ):
                raise ConfigError(
                    f"node {n.name!r}: it consumes embeddings from an encoder over Mooncake, but its "
                    "kv_transport is cuda_ipc; use tcp or rdma on nodes of a model with an encoder"
                )

    def _check_models(self) -> None:
        if self.model is not None and all(n.model != self.model for n in self.nodes):
            raise ConfigError(
                f"model {self.model!r} is served by no node (every node names its own model): "
                "remove the top-level `model` or let a node use it"
            )
        for model in self.models:
            users = [n for n in self.nodes if n.model == model]
            if not any(n.role.decodes for n in users):
                raise ConfigError(
                    f"model {model!r} is served by no decode-capable node (only "
                    f"{[n.name for n in users]}): add a decode or colocated node with this model"
                )
            # P and D compare block_size at the KV handshake (docs/design.md §3); fail now, not per request.
            kv_nodes = [n for n in users if n.role is not Role.ENCODER]
            if len({n.block_size for n in kv_nodes}) > 1:
                sizes = {n.name: n.block_size for n in kv_nodes}
                raise ConfigError(
                    f"nodes of model {model!r} exchange KV and must share block_size, got {sizes}"
                )
        by_name: dict[str, str] = {}
        for model in self.models:
            name = self.served_name(model)
            if by_name.setdefault(name, model) != model:
                raise ConfigError(
                    f"models {by_name[name]!r} and {model!r} are both served as {name!r}: "
                    "rename a checkpoint folder or set served_model_name"
                )

    def _check_addresses(self) -> None:
        owners: dict[tuple[str, int], str] = {}
        endpoints = [("router.port", self.router.host, self.router.port)]
        for n in self.nodes:
            endpoints += [(f"{n.name}.grpc_port", n.host, n.grpc_port)]
            endpoints += [(f"{n.name}.metrics_port", n.host, n.metrics_port)]
            if n.frontend_port:  # 0 / None: a free port picked at start
                endpoints += [(f"{n.name}.frontend_port", n.host, n.frontend_port)]
        for owner, host, port in endpoints:
            key = (_normalize_host(host), port)
            if key in owners:
                raise ConfigError(
                    f"{owners[key]} and {owner} both use {host}:{port}: give each a distinct port"
                )
            owners[key] = owner

    # -- lookups ------------------------------------------------------------------------------

    def node(self, name: str) -> NodeConfig:
        for n in self.nodes:
            if n.name == name:
                return n
        raise UnknownNodeError(
            f"no node named {name!r} in the cluster config; known nodes: {[n.name for n in self.nodes]}"
        )

    def nodes_with_role(self, role: Role) -> tuple[NodeConfig, ...]:
        return tuple(n for n in self.nodes if n.role is role)

    @property
    def prefill_nodes(self) -> tuple[NodeConfig, ...]:
        return self.nodes_with_role(Role.PREFILL)

    @property
    def decode_nodes(self) -> tuple[NodeConfig, ...]:
        """Nodes that can decode: role decode or colocated."""
        return tuple(n for n in self.nodes if n.role.decodes)

    @property
    def encoder_nodes(self) -> tuple[NodeConfig, ...]:
        return self.nodes_with_role(Role.ENCODER)

    @property
    def models(self) -> tuple[str, ...]:
        """Distinct checkpoints, in order of first use."""
        return tuple(dict.fromkeys(n.model for n in self.nodes))

    def served_name(self, model: str) -> str:
        """The name clients use for ``model`` (OpenAI ``model`` field)."""
        if model == self.model and self.served_model_name:
            return self.served_model_name
        if "/" in model and looks_like_hf_id(model):  # Org/Name: served as written, as vLLM does
            return model
        return Path(model).name or model

    @property
    def router_url(self) -> str:
        return f"http://{self.router.host}:{self.router.port}"

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "cluster config") -> ClusterConfig:
        """Validate ``data``; every problem becomes one ConfigError listing each bad field."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            lines = [_describe_error(err, data, cls) for err in e.errors()]
            raise ConfigError(f"{source}: " + "; ".join(lines)) from None


def _normalize_host(host: str) -> str:
    host = host.lower().rstrip(".")
    return "127.0.0.1" if host == "localhost" else host
