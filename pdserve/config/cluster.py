"""The cluster config file: every node of one deployment, its address, model, sizes and roles.

One file (YAML or TOML, chosen by extension) describes the whole deployment; each node reads
its own entry, the router reads all of them. Settings that follow from the roles
(``kv_role`` when omitted, ``ec_role``, ``accept_mm_embeds``, ``allow_missing_mm_embeds``) are
derived by :func:`pdserve.config.resolver.resolve_node_settings`, not here.

Everything that can be checked without the checkpoint is checked at load, and every problem
is a :class:`~pdserve.errors.ConfigError` that names the field and the fix.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pdserve.errors import ConfigError

Role = Literal["prefill", "decode", "encoder", "colocated"]
KvRole = Literal["kv_producer", "kv_consumer", "kv_both"]
EcRole = Literal["ec_producer", "ec_consumer"]

# The KV role each service type holds (DESIGN §1). An explicit kv_role must equal it: a prefill
# node that consumes KV is a contradiction, not a preference.
KV_ROLE_OF_ROLE: dict[str, KvRole | None] = {
    "prefill": "kv_producer",
    "decode": "kv_consumer",
    "colocated": "kv_both",
    "encoder": None,
}
DECODE_CAPABLE_ROLES = ("decode", "colocated")
# Token budget of one step when the file sets none. A prefill node only turns prompts into KV:
# large steps keep the tensor cores busy (H200, Llama-1B shape, 2k-token prompts: 0.545 of the
# bf16 peak at 8,192-16,384 tokens against 0.337 at 2,048, docs/benchmarks.md issue 17). Every
# other role keeps 2,048, which bounds the inter-token latency of the decodes sharing a step.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
PREFILL_MAX_NUM_BATCHED_TOKENS = 16384
_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class UnknownNodeError(ConfigError, KeyError):
    """``ClusterConfig.node(name)`` for a name the file does not list."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RouterConfig(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)  # OpenAI HTTP API and /metrics
    api_key: str | None = None  # clients send "Authorization: Bearer <api_key>" when set
    policy: Literal["least_loaded", "prefix_affinity", "round_robin"] = "least_loaded"
    # Conditional disaggregation: prompts shorter than this prefill on the decode node, where a
    # KV transfer would cost more than the prefill itself. 0 disaggregates every prompt.
    local_prefill_max_tokens: int = Field(default=32, ge=0)
    request_timeout_s: float = Field(default=600.0, gt=0)  # whole request, first byte to last token
    # The prefill leg's deadline: P.Prefill call -> first token with the KV held (P's queue +
    # the prompt's prefill). Past it the router aborts the leg (P frees the KV at once) and tries
    # the next prefill node, then prefills on the decode node. Catches a wedged prefill engine
    # that still answers gRPC keepalive pings (a frozen process is noticed sooner, by keepalive).
    prefill_timeout_s: float = Field(default=30.0, gt=0)
    # Request lifecycle under failure (issue 13). Bounded input: past these a request is a 400/413.
    max_body_bytes: int | None = Field(default=None, ge=1024)  # None: max(16 MiB, room for prompt_embeds)
    max_prompts_per_request: int = Field(default=256, ge=1)  # entries of a completions batch
    max_sequences_per_request: int = Field(default=256, ge=1)  # prompts x n
    # Per-leg deadlines: a frozen (SIGSTOPped) or dead peer is noticed by these, not by the lease.
    decode_first_token_timeout_s: float = Field(
        default=30.0, gt=0
    )  # D.Decode call -> first delta (incl. pull)
    inter_token_timeout_s: float = Field(default=15.0, gt=0)  # gap between two deltas of a stream
    # Circuit breaker per node: this many consecutive node faults take it out of rotation for
    # breaker_open_s; then one probe request (half-open) decides. 4xx / 429 are not node faults.
    breaker_failures: int = Field(default=3, ge=1)
    breaker_open_s: float = Field(default=5.0, gt=0)
    http_keepalive_s: float = Field(default=75.0, ge=1)  # idle HTTP keep-alive connections close after this
    # Parses chat output under tool_choice auto into tool_calls (services/router/tool_parsers);
    # a name the router does not know is refused when the router starts, naming the known ones.
    tool_call_parser: str = "hermes"
    # Who makes the text of a sequence without stop strings: "router" (the nodes send token ids
    # only, so their engine threads skip it) or "node". Stop strings are always matched on the
    # node, which makes their text.
    detokenize: Literal["router", "node"] = "router"
    encode_timeout_s: float = Field(default=60.0, gt=0)  # router -> encoder Encode call (issue 14)
    # How decode legs reach a node (issue 12): multiplexed = one Steps stream per node carrying
    # batched deltas of every leg; per_request = one Decode stream per leg (a message per token).
    decode_stream: Literal["multiplexed", "per_request"] = "multiplexed"
    # Non-streaming requests on the multiplexed stream: the node holds their tokens and sends them
    # at most every this many ms (and at their end) instead of with every step; 0 = every step.
    # Must stay well under inter_token_timeout_s, which also bounds the gap between their messages.
    nonstream_flush_ms: int = Field(default=100, ge=0, le=60_000)
    # Streaming requests on the multiplexed stream, likewise (vLLM's stream_interval, in time):
    # the first token at once, then a stream's tokens merged into one message and one SSE event
    # at most every this many ms, and the finish at once; 0 = every engine step. A stream whose
    # tokens come slower than this (most GPU serving) is not touched; a faster one (a small model,
    # a CPU host) gets them in groups, at 100 events/s at most by default, and its node, router
    # and client spend that much less per token (docs/benchmarks.md, thirteenth session).
    stream_flush_ms: int = Field(default=10, ge=0, le=60_000)
    # When a P/D request's decode leg opens (multiplexed only): with_prefill = together with the
    # prefill leg, so decode allocates and asks for the KV while the prompt is prefilled and the
    # pull brings the first token; after_prefill = once the first token is back (one leg, then
    # the other). A failed early pull is re-driven by the router as a failed pull is under
    # kv_load_failure_policy reprefill.
    pd_decode_leg: Literal["with_prefill", "after_prefill"] = "with_prefill"
    # Router worker processes sharing the HTTP port (issue 12): each runs its own event loop,
    # node connections and registry view; /metrics adds them up. 1 = the router is one process.
    workers: int = Field(default=1, ge=1, le=64)

    @model_validator(mode="after")
    def _check_timeouts(self) -> RouterConfig:
        # Both have non-zero defaults, which per_request does without; an explicit one is refused.
        held = {
            "nonstream_flush_ms": "nonstream_flush_ms" in self.model_fields_set,
            "stream_flush_ms": "stream_flush_ms" in self.model_fields_set and self.stream_flush_ms > 0,
        }
        if (
            self.decode_stream == "per_request"
            and self.pd_decode_leg == "with_prefill"
            and ("pd_decode_leg" in self.model_fields_set)
        ):
            raise ConfigError(
                "router.pd_decode_leg with_prefill needs router.decode_stream multiplexed (the Steps "
                "stream); per_request opens the decode leg after the prefill leg"
            )
        for name, asked in held.items():
            ms = getattr(self, name)
            if self.decode_stream == "per_request" and asked:
                raise ConfigError(
                    f"router.{name} ({ms}) needs router.decode_stream multiplexed (the Steps "
                    "stream); per_request sends every step's tokens"
                )
            if ms / 1000.0 > self.inter_token_timeout_s / 2:
                raise ConfigError(
                    f"router.{name} ({ms}) is over half of router.inter_token_timeout_s "
                    f"({self.inter_token_timeout_s} s): a held request would look like a stalled node; "
                    "lower it"
                )
        if self.prefill_timeout_s > self.request_timeout_s:
            raise ConfigError(
                f"router.prefill_timeout_s ({self.prefill_timeout_s}) exceeds router.request_timeout_s "
                f"({self.request_timeout_s}); the prefill leg is part of the request, lower it"
            )
        return self


class FaultsConfig(_Frozen):
    """Test-only fault injection (bench/chaos.py, tests/e2e): every field off by default. Each one
    is acted on by the node; one that cannot apply to the node's role is refused at start."""

    # SIGUSR1 makes the node's engine thread die (as an uncaught device fault would): the node
    # turns NOT_SERVING, fails its in-flight requests and exits with 70.
    engine_death_on_sigusr1: bool = False
    # prefill: every PushKV waits this long right before its KV write (a slow transfer window)
    push_delay_s: float = Field(default=0.0, ge=0)
    # prefill: every Prefill answers this long after its first token is ready (a slow prefill)
    prefill_reply_delay_s: float = Field(default=0.0, ge=0)
    # encoder: every Encode waits this long before encoding (a window to fault "while encoding")
    encode_delay_s: float = Field(default=0.0, ge=0)
    # encoder: every PushEmbeddings waits this long before its write into prefill (a push window)
    ec_push_delay_s: float = Field(default=0.0, ge=0)


class NodeConfig(_Frozen):
    name: str
    role: Role  # service type
    model: str  # checkpoint folder; filled from the file's top-level `model` when omitted
    host: str = "127.0.0.1"  # the address peers and the router dial (not necessarily the bind address)
    grpc_port: int = Field(ge=1, le=65535)
    metrics_port: int = Field(ge=1, le=65535)  # Prometheus /metrics of the node
    kv_role: KvRole | None = None  # None: derived from role
    ec_role: EcRole | None = None  # derived by the resolver
    tp: int = 1
    pp: int = 1
    # layers per pipeline stage (len pp, sums to the model's layers); None: even split
    pp_layer_split: tuple[int, ...] | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    kv_transport: Literal["tcp", "rdma", "cuda_ipc"] = "tcp"  # Mooncake TCP / RDMA, or same-host CUDA IPC
    kv_cache_memory_bytes: int | None = Field(default=None, gt=0)
    max_num_seqs: int = Field(default=64, ge=1)
    # Token budget of one engine step. None: derived from the role by the resolver (prefill
    # PREFILL_MAX_NUM_BATCHED_TOKENS, every other role DEFAULT_MAX_NUM_BATCHED_TOKENS); a value
    # written in the file is kept.
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    # Overload (issue 12): requests that do not fit wait in the queue; past max_queue_len waiting
    # (admitted, never scheduled) a new one is refused, and one waiting longer than
    # max_queue_wait_s is dropped: both reach the client as the router's 503 (OpenAI error body),
    # holding nothing on any node. None: unbounded.
    max_queue_len: int | None = Field(default=None, ge=1)
    max_queue_wait_s: float | None = Field(default=None, gt=0)
    block_size: int = 16
    kv_load_failure_policy: Literal["fail", "recompute", "reprefill"] = "recompute"  # decode side
    kv_lease_s: float = Field(default=30.0, gt=0)  # prefill side: how long KV waits for its consumer
    # decode side: every this many seconds, KeepAlive(transfer_ids) to each prefill node for the
    # requests still queued here, so their leases outlive a long queue (must be < the lease)
    kv_keepalive_s: float | None = Field(default=None, gt=0)  # None: min(5 s, shortest prefill lease / 3)
    kv_checksum: bool = False  # decode: verify a digest of every pulled transfer (kvtransfer/checksum.py)
    max_model_len: int | None = Field(default=None, ge=1)
    enforce_eager: bool = False  # CUDA: no CUDA graphs
    async_scheduling: bool | None = None  # None: on for CUDA (see EngineConfig.async_scheduling)
    step_timeout_s: float = Field(default=300.0, gt=0)  # a device step taking longer fails its requests
    # torch's intra-op CPU threads per engine process (see EngineConfig.cpu_threads); None: half
    # the usable cores on a CPU device, torch's default elsewhere
    cpu_threads: int | None = Field(default=None, ge=1)
    # SIGTERM: stop admitting, finish in-flight work for at most this long, then exit (k8s:
    # terminationGracePeriodSeconds must exceed it, see deploy/k8s).
    drain_timeout_s: float = Field(default=30.0, gt=0)
    # Embedding cache (issue 14). Encoder: its registered buffer of embeddings and their lease in
    # the Redis index; EC consumers (prefill): the buffer pushes land in, the reservation lease and
    # how long one fetch from an encoder may take.
    ec_buffer_bytes: int = Field(default=64 << 20, ge=1 << 16)
    ec_lease_s: float = Field(default=30.0, gt=0)
    ec_fetch_timeout_s: float = Field(default=30.0, gt=0)
    # Where images are decoded (an encoder, or a prefill node of a model no encoder serves):
    # images past these are a 400 before any pixel is decoded.
    max_image_bytes: int | None = Field(default=None, ge=1)  # None: 20 MiB
    max_image_pixels: int | None = Field(default=None, ge=1)  # None: 4096 x 4096
    accept_mm_embeds: bool = False  # derived (may only be turned on), see the resolver
    faults: FaultsConfig = FaultsConfig()  # test-only fault injection (off)
    allow_missing_mm_embeds: bool = False  # derived, see the resolver
    # Decode / colocated: who serves the router's Steps streams (the token streams).
    #   socket (the default there): the node itself, on a TCP port of length-prefixed frames
    #     (services/steps_socket.py); the engine thread writes token deltas to the router's
    #     connection directly, no gRPC and no other process on the hot path;
    #   process: a front-end process speaking gRPC to the router (services/steps_frontend.py);
    #     the engine thread writes token deltas to it over a Unix socket;
    #   inline: the node's own gRPC server, one process.
    # None: socket on decode and colocated nodes; prefill nodes serve no Steps streams.
    frontend: Literal["socket", "process", "inline"] | None = None
    # The Steps port (socket, process); None or 0: any free port (the router learns it from GetLoad).
    frontend_port: int | None = Field(default=None, ge=0, le=65535)

    def steps_frontend(self) -> str | None:
        """Who serves this node's Steps streams on ``steps_port``: socket | process; None: the
        node's own gRPC port (inline), or no Steps streams at all (prefill)."""
        if self.role not in ("decode", "colocated") or self.frontend == "inline":
            return None
        return self.frontend or "socket"

    def steps_port(self) -> int | None:
        """The port of this node's Steps socket or front-end process (0: any free one); None: none."""
        return None if self.steps_frontend() is None else (self.frontend_port or 0)

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ConfigError(
                f"node name {v!r} is invalid: use letters, digits, '-', '_' and '.', "
                "starting and ending with a letter or digit (it becomes a metric label and a DNS-ish id)"
            )
        return v

    @field_validator("tp", "pp")
    @classmethod
    def _check_parallel(cls, v: int, info: Any) -> int:
        if v < 1:
            what = "GPUs per pipeline stage" if info.field_name == "tp" else "pipeline stages"
            raise ConfigError(f"{info.field_name} must be >= 1 (the number of {what}), got {v}; use 1")
        return v

    @field_validator("block_size")
    @classmethod
    def _check_block_size(cls, v: int) -> int:
        if v <= 0 or v & (v - 1):
            raise ConfigError(f"block_size must be a power of two > 0 (e.g. 16), got {v}")
        return v

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {v!r}")
        return v

    @model_validator(mode="after")
    def _check_roles(self) -> NodeConfig:
        if self.role not in ("decode", "colocated"):
            for key, value in (("frontend", self.frontend), ("frontend_port", self.frontend_port)):
                if value is not None:
                    raise ConfigError(
                        f"node {self.name!r}: {key} {value} is for decode and colocated nodes (the "
                        f"router's Steps streams); a {self.role} node serves none: remove it"
                    )
        elif self.frontend == "inline" and self.frontend_port is not None:
            raise ConfigError(
                f"node {self.name!r}: frontend_port {self.frontend_port} with frontend: inline (the "
                "node's own gRPC port serves the Steps streams): remove frontend_port or set "
                "frontend: socket or process"
            )
        expected = KV_ROLE_OF_ROLE[self.role]
        if self.kv_role is not None and self.kv_role != expected:
            fix = f"set kv_role: {expected} or omit it" if expected else "omit kv_role"
            raise ConfigError(
                f"node {self.name!r}: role {self.role} contradicts kv_role {self.kv_role} "
                f"(a {self.role} node holds kv_role {expected}); {fix}"
            )
        if self.ec_role == "ec_producer" and self.role != "encoder":
            raise ConfigError(
                f"node {self.name!r}: only encoder nodes produce embeddings, but role {self.role} "
                "has ec_role ec_producer; omit ec_role (it is derived) or make the node role: encoder"
            )
        f = self.faults
        if (f.push_delay_s or f.prefill_reply_delay_s) and self.role != "prefill":
            raise ConfigError(
                f"node {self.name!r}: faults.push_delay_s / faults.prefill_reply_delay_s act on "
                f"prefill nodes only, not on role {self.role}; remove them"
            )
        if (f.encode_delay_s or f.ec_push_delay_s) and self.role != "encoder":
            raise ConfigError(
                f"node {self.name!r}: faults.encode_delay_s / faults.ec_push_delay_s act on "
                f"encoder nodes only, not on role {self.role}; remove them"
            )
        if f.engine_death_on_sigusr1 and self.role == "encoder":
            raise ConfigError(
                f"node {self.name!r}: faults.engine_death_on_sigusr1 is not supported on encoder nodes"
            )
        if self.role == "encoder" and self.ec_role == "ec_consumer":
            raise ConfigError(
                f"node {self.name!r}: an encoder node is an ec_producer, not an ec_consumer; omit ec_role"
            )
        if self.role not in ("encoder", "prefill"):
            for name in ("max_image_bytes", "max_image_pixels"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"node {self.name!r}: {name} is a setting of the node that decodes images (an "
                        f"encoder, or a prefill node with no encoder in the cluster), but the node's "
                        f"role is {self.role}; move it there"
                    )
        if self.role == "encoder":
            if self.tp != 1 or self.pp != 1:
                raise ConfigError(
                    f"node {self.name!r}: an encoder runs on one device (tp 1, pp 1), got tp {self.tp}, "
                    f"pp {self.pp}; add encoder nodes to scale out instead"
                )
            if self.kv_transport == "cuda_ipc":
                raise ConfigError(
                    f"node {self.name!r}: embeddings move over Mooncake (kv_transport tcp or rdma), "
                    "not cuda_ipc; set kv_transport: tcp"
                )
        return self

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_address(self) -> str:
        return f"{self.host}:{self.metrics_port}"


class ClusterConfig(_Frozen):
    model: str | None = None  # default checkpoint of every node that does not name its own
    served_model_name: str | None = None  # name of `model` in the API; default: its folder name
    router: RouterConfig = RouterConfig()  # frozen, so one shared default is safe
    redis_url: str | None = None  # node registry / embedding-cache index
    shared_token: str | None = None  # internal gRPC calls carry "authorization: Bearer <token>"
    # Redis registry: a node's entry expires this long after its last heartbeat (beats every TTL/3).
    registry_ttl_s: float = Field(default=10.0, gt=0)
    nodes: tuple[NodeConfig, ...]

    @model_validator(mode="after")
    def _check_registry(self) -> ClusterConfig:
        if "registry_ttl_s" in self.model_fields_set and not self.redis_url:
            raise ConfigError(
                f"registry_ttl_s ({self.registry_ttl_s}) is set but redis_url is not: the TTL is the "
                "Redis registry's; set redis_url or remove registry_ttl_s (the static node list has none)"
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
        if not any(n.role in DECODE_CAPABLE_ROLES for n in self.nodes):
            raise ConfigError(
                "no decode-capable node: add a node with role decode or colocated "
                "(a prefill node hands its KV to one; without it no request can finish)"
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
        leases = [n.kv_lease_s for n in self.nodes if n.role == "prefill"]
        return min([5.0] + [lease / 3 for lease in leases])

    def _check_keepalive(self) -> None:
        """Decode's KeepAlive must come more often than any prefill lease runs out (issue 13)."""
        leases = [n.kv_lease_s for n in self.nodes if n.role == "prefill"]
        for n in self.nodes:
            if (
                n.role == "decode"
                and leases
                and n.kv_keepalive_s is not None
                and n.kv_keepalive_s >= min(leases)
            ):
                raise ConfigError(
                    f"node {n.name!r}: kv_keepalive_s ({n.kv_keepalive_s}) must be below the shortest "
                    f"prefill kv_lease_s ({min(leases)}), or queued requests lose their KV; lower it"
                )

    def _check_encoders(self) -> None:
        """The embedding-cache index lives in Redis (DESIGN §3): an encoder needs redis_url."""
        if self.encoder_nodes and not self.redis_url:
            names = [n.name for n in self.encoder_nodes]
            raise ConfigError(
                f"encoder nodes {names} need redis_url: the embedding-cache index (key -> owner, "
                "address, shape, expiry) lives in Redis; set redis_url or remove the encoder nodes"
            )
        for n in self.nodes:
            if (
                n.role != "encoder"
                and n.kv_transport == "cuda_ipc"
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
            if not any(n.role in DECODE_CAPABLE_ROLES for n in users):
                raise ConfigError(
                    f"model {model!r} is served by no decode-capable node (only "
                    f"{[n.name for n in users]}): add a decode or colocated node with this model"
                )
            # P and D compare block_size at the KV handshake (DESIGN §3); fail now, not per request.
            kv_nodes = [n for n in users if n.role != "encoder"]
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
        return tuple(n for n in self.nodes if n.role == role)

    @property
    def prefill_nodes(self) -> tuple[NodeConfig, ...]:
        return self.nodes_with_role("prefill")

    @property
    def decode_nodes(self) -> tuple[NodeConfig, ...]:
        """Nodes that can decode: role decode or colocated."""
        return tuple(n for n in self.nodes if n.role in DECODE_CAPABLE_ROLES)

    @property
    def encoder_nodes(self) -> tuple[NodeConfig, ...]:
        return self.nodes_with_role("encoder")

    @property
    def models(self) -> tuple[str, ...]:
        """Distinct checkpoints, in order of first use."""
        return tuple(dict.fromkeys(n.model for n in self.nodes))

    def served_name(self, model: str) -> str:
        """The name clients use for ``model`` (OpenAI ``model`` field)."""
        if model == self.model and self.served_model_name:
            return self.served_model_name
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
            lines = [_describe_error(err, data) for err in e.errors()]
            raise ConfigError(f"{source}: " + "; ".join(lines)) from None


def load_cluster_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> ClusterConfig:
    """Read a cluster config (``.yaml`` / ``.yml`` / ``.toml``).

    ``${NAME}`` in a string value is replaced by the environment variable ``NAME`` (``env``,
    default ``os.environ``) so secrets such as ``shared_token`` can come from a k8s Secret.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise ConfigError(f"cluster config {p}: unknown extension {p.suffix!r}; use .yaml, .yml or .toml")
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read cluster config {p}: {e.strerror or e}") from e
    try:
        data = tomllib.loads(text) if suffix == ".toml" else yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cluster config {p} is not valid {suffix[1:].upper()}: {e}") from e
    data = _expand_env(data, os.environ if env is None else env, str(p))
    return ClusterConfig.from_dict(data, source=f"cluster config {p}")


def write_cluster_config(cluster: ClusterConfig, path: str | os.PathLike[str]) -> Path:
    """Write ``cluster`` as YAML (for ``pdserve up`` to hand its child processes one file).

    Only fields that were set are written, so derived fields stay derived on reload.
    """
    p = Path(path)
    if p.suffix.lower() not in (".yaml", ".yml"):
        raise ConfigError(f"write_cluster_config writes YAML; use a .yaml path, got {p}")
    p.write_text(yaml.safe_dump(cluster.model_dump(mode="json", exclude_unset=True), sort_keys=False))
    return p


def default_local_cluster(
    model_dir: str | os.PathLike[str],
    base_port: int = 8000,
    *,
    host: str = "127.0.0.1",
    served_model_name: str | None = None,
    encoder_redis_url: str | None = None,
) -> ClusterConfig:
    """The cluster ``pdserve up`` starts: router + one prefill + one decode node on one host, and
    with ``encoder_redis_url`` (a multimodal model) an encoder whose index lives there.

    Ports, from ``base_port``:

        base+0  router HTTP (OpenAI API, /metrics)
        base+1  prefill-0 gRPC      base+2  prefill-0 /metrics
        base+3  decode-0 gRPC       base+4  decode-0 /metrics
        base+5  encoder-0 gRPC      base+6  encoder-0 /metrics   (with an encoder)
    """
    span = 7 if encoder_redis_url else 5
    if not 1 <= base_port <= 65536 - span:
        raise ConfigError(
            f"base_port must be in [1, {65536 - span}] ({span} ports are used), got {base_port}"
        )
    nodes = [
        {"name": "prefill-0", "role": "prefill", "host": host}
        | {"grpc_port": base_port + 1, "metrics_port": base_port + 2},
        {"name": "decode-0", "role": "decode", "host": host}
        | {"grpc_port": base_port + 3, "metrics_port": base_port + 4},
    ]
    data: dict[str, Any] = {
        "model": str(model_dir),
        "served_model_name": served_model_name,
        "router": {"host": host, "port": base_port},
        "nodes": nodes,
    }
    if encoder_redis_url:
        nodes.insert(
            0,
            {"name": "encoder-0", "role": "encoder", "host": host}
            | {"grpc_port": base_port + 5, "metrics_port": base_port + 6},
        )
        data["redis_url"] = encoder_redis_url
    return ClusterConfig.from_dict(data, source="default local cluster")


def _normalize_host(host: str) -> str:
    host = host.lower().rstrip(".")
    return "127.0.0.1" if host == "localhost" else host


def _expand_env(value: Any, env: Mapping[str, str], source: str) -> Any:
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            if m.group(1) not in env:
                raise ConfigError(
                    f"cluster config {source} uses ${{{m.group(1)}}}, which is not set; "
                    "set that environment variable or write the value"
                )
            return env[m.group(1)]

        return _ENV_RE.sub(sub, value)
    if isinstance(value, dict):
        return {k: _expand_env(v, env, source) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, env, source) for v in value]
    return value


def _describe_error(err: Any, data: Mapping[str, Any]) -> str:
    loc = tuple(err["loc"])
    if err["type"] == "extra_forbidden":
        parent: type[BaseModel] = ClusterConfig
        if loc[0] == "nodes":
            parent = NodeConfig
        elif loc[0] == "router" and len(loc) == 2:
            parent = RouterConfig
        allowed = list(parent.model_fields)
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        where = _format_loc(loc[:-1], data) or "top level"
        return f"unknown field {loc[-1]!r} in {where}; {hint}allowed: {', '.join(allowed)}"
    where = _format_loc(loc, data)
    if err["type"] == "value_error" and isinstance(err.get("ctx", {}).get("error"), ConfigError):
        msg = str(err["ctx"]["error"])
        return f"{where}: {msg}" if where else msg
    if err["type"] == "missing":
        return f"{where}: required field is missing"
    got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
    return f"{where}: {err['msg']}{got}"


def _format_loc(loc: tuple[Any, ...], data: Mapping[str, Any]) -> str:
    """("nodes", 1, "tp") -> "nodes[1] ('decode-0').tp"."""
    where = ""
    for part in loc:
        where += f"[{part}]" if isinstance(part, int) else (f".{part}" if where else str(part))
        if isinstance(part, int) and loc[0] == "nodes":
            try:
                where += f" ({data['nodes'][part]['name']!r})"
            except (KeyError, IndexError, TypeError):
                pass
    return where
