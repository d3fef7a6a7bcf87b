"""What one node process starts from: :class:`NodeSpec`.

    cluster file --load--> ClusterConfig --resolve_node_settings--> ResolvedNode
                                                                        |  NodeSpec.start()
                                                                        v
    NodeSpec = the node's resolved entry + the cluster-wide values + its EngineConfig
               + the addresses of this host (bind, KV, advertised)

Every setting was validated once, at load, into its type (the closed sets are the enums of
:mod:`pdserve.config.choices`); the node reads them here under the entry's own names
(``spec.kv_transport``, ``spec.kv_load_failure_policy``, ...) and never parses them again.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.config.choices import EcRole, KvLoadFailurePolicy, KvTransport, Role
from pdserve.config.cluster import ClusterConfig
from pdserve.config.engine import EngineConfig, ParallelConfig
from pdserve.config.node_settings import FaultsConfig, NodeConfig
from pdserve.config.resolver import MmPolicy, ResolvedNode, checkpoint_is_multimodal, resolve_node_settings

if TYPE_CHECKING:
    from pdserve.models.image_processor import ImageLimits


@dataclass(frozen=True)
class NodeSpec:
    """One node's settings, as the node process acts on them (see the module docstring)."""

    resolved: ResolvedNode  # the file's entry with its derived fields, and the whole cluster
    engine: EngineConfig  # the entry's engine settings, the model resolved to a local folder
    host: str  # the address the node's servers bind
    kv_host: str  # the address peers reach its transfer engine at
    advertise_address: str  # host:port the router and peers dial (k8s: the pod IP)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        resolved: ResolvedNode,
        *,
        bind_host: str | None = None,
        advertise_host: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> NodeSpec:
        """The spec of ``pdserve serve``: the model resolved to a folder (a .gguf converted, a
        Hugging Face id fetched), and this host's addresses.

        ``bind_host`` default: the node's host if it is an IP (localhost: 127.0.0.1), else every
        interface (a DNS name may name a Service address this host cannot bind). The KV address
        is ``PDSERVE_KV_HOST`` in ``env``, else the node's host if an IP, else this host's."""
        from pdserve.models.resolve import resolve_model_path

        env = os.environ if env is None else env
        n = resolved.node
        model_dir = str(resolve_model_path(n.model))
        host = bind_host or ("127.0.0.1" if n.host == "localhost" else n.host if is_ip(n.host) else "0.0.0.0")
        kv_host = env.get("PDSERVE_KV_HOST") or (
            n.host if is_ip(n.host) else socket.gethostbyname(socket.gethostname())
        )
        return cls(
            resolved=resolved,
            engine=dataclasses.replace(resolved.engine_config(), model=model_dir),
            host=host,
            kv_host=kv_host,
            advertise_address=f"{advertise_host or n.host}:{n.grpc_port}",
        )

    @classmethod
    def for_test(
        cls,
        name: str,
        role: Role | str,
        engine: EngineConfig,
        *,
        grpc_port: int = 50061,
        metrics_port: int | None = None,
        cluster: Mapping[str, Any] | None = None,
        is_multimodal: Callable[[str], bool] = checkpoint_is_multimodal,
        **node_fields: Any,
    ) -> NodeSpec:
        """A node of a small cluster file built here (tests and bench scripts): ``engine`` as
        given (its pp, tp and pcp become the entry's), ``node_fields`` the entry's other keys and
        ``cluster`` the file's top-level keys, validated as a file's. A prefill node's file also
        lists one decode node (a cluster file needs one); it is never dialled."""
        par: ParallelConfig = engine.parallel
        entry: dict[str, Any] = {"name": name, "role": str(role), "model": engine.model, "host": "127.0.0.1"}
        entry |= {"grpc_port": grpc_port, "metrics_port": metrics_port or free_port()}
        entry |= {"pp": par.pipeline_parallel_size, "tp": par.tensor_parallel_size, **node_fields}
        if par.prefill_context_parallel_size > 1:
            entry["pcp"] = par.prefill_context_parallel_size
        nodes = [entry]
        if not Role(role).decodes:
            peer = {"name": f"{name}-peer", "role": "decode", "model": engine.model, "host": "192.0.2.1"}
            nodes.append(peer | {"grpc_port": 1, "metrics_port": 2})  # TEST-NET-1: never dialled
        data = {**(cluster or {}), "nodes": nodes}
        resolved = resolve_node_settings(ClusterConfig.from_dict(data), name, is_multimodal=is_multimodal)
        address = f"127.0.0.1:{grpc_port}"
        return cls(
            resolved=resolved, engine=engine, host="127.0.0.1", kv_host="127.0.0.1", advertise_address=address
        )

    # -- the entry's settings -----------------------------------------------------------------

    @property
    def node(self) -> NodeConfig:
        return self.resolved.node

    @property
    def cluster(self) -> ClusterConfig:
        return self.resolved.cluster

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def role(self) -> Role:
        return self.node.role

    @property
    def grpc_port(self) -> int:
        return self.node.grpc_port

    @property
    def metrics_port(self) -> int:
        return self.node.metrics_port

    @property
    def kv_transport(self) -> KvTransport:
        return self.node.kv_transport

    @property
    def kv_lease_s(self) -> float:
        return self.node.kv_lease_s

    @property
    def kv_checksum(self) -> bool:
        return self.node.kv_checksum

    @property
    def kv_ready_timeout_s(self) -> float:
        return self.node.kv_ready_timeout_s

    @property
    def kv_pull_timeout_s(self) -> float:
        return self.node.kv_pull_timeout_s

    @property
    def kv_load_failure_policy(self) -> KvLoadFailurePolicy:
        return self.node.kv_load_failure_policy

    @property
    def drain_timeout_s(self) -> float:
        return self.node.drain_timeout_s

    @property
    def faults(self) -> FaultsConfig:
        return self.node.faults

    @property
    def ec_buffer_bytes(self) -> int:
        return self.node.ec_buffer_bytes

    @property
    def ec_lease_s(self) -> float:
        return self.node.ec_lease_s

    @property
    def ec_fetch_timeout_s(self) -> float:
        return self.node.ec_fetch_timeout_s

    # The router's Steps streams (decode / colocated): the Steps socket (services/steps_socket.py)
    # on frontend_port (0: any free port); None: the node serves none (prefill).
    @property
    def frontend_port(self) -> int | None:
        return self.node.steps_port()

    @property
    def steps_hello_timeout_s(self) -> float:
        return self.node.steps_hello_timeout_s

    @property
    def steps_max_pending_per_peer(self) -> int:
        return self.node.steps_max_pending_per_peer

    # -- the cluster-wide values it acts on ---------------------------------------------------

    @property
    def shared_token(self) -> str | None:
        return self.cluster.shared_token

    @property
    def redis_url(self) -> str | None:
        return self.cluster.redis_url

    @property
    def registry_ttl_s(self) -> float:
        return self.cluster.registry_ttl_s

    @property
    def allow_unauthenticated_kv_ports(self) -> bool:
        return self.cluster.allow_unauthenticated_kv_ports

    @property
    def metrics_require_token(self) -> bool:
        return self.cluster.metrics_require_token

    @property
    def kv_keepalive_s(self) -> float:
        """Decode: the KeepAlive period of transfers queued here (below every prefill lease)."""
        return self.cluster.keepalive_s(self.node)

    # -- what follows from them ---------------------------------------------------------------

    @property
    def stages(self) -> int:
        """Pipeline stages behind this node's address (registered, for the router)."""
        return self.engine.parallel.pipeline_parallel_size

    @property
    def mm_policy(self) -> MmPolicy:
        return self.resolved.mm_policy

    @property
    def ec_consumer(self) -> bool:
        """Fetches image embeddings from encoder nodes (index in Redis at redis_url)."""
        return self.resolved.ec_role is EcRole.EC_CONSUMER

    @property
    def colocated_encoder(self) -> bool:
        """A prefill node of a multimodal model that no encoder serves: it encodes images itself."""
        r = self.resolved
        return r.role is Role.PREFILL and r.is_multimodal and r.ec_role is None

    @property
    def image_limits(self) -> ImageLimits:
        """Where images are decoded here: past these, a request is a 400 before any decoding."""
        from pdserve.models.image_processor import ImageLimits

        d = ImageLimits()
        n = self.node
        return ImageLimits(
            max_image_bytes=n.max_image_bytes or d.max_image_bytes,
            max_image_pixels=n.max_image_pixels or d.max_image_pixels,
        )


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
