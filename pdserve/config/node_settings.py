"""One entry of the cluster file's ``nodes`` list: a node's role, address, model, sizes and limits.

Also how the roles relate (the enums themselves: :mod:`pdserve.config.choices`) and the
per-role defaults the resolver applies, and the node's test-only fault injection
(:class:`FaultsConfig`). Checks that need only the node itself are made here; checks across
nodes are :class:`~pdserve.config.cluster.ClusterConfig`'s.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from pdserve.config.choices import Dtype, EcRole, KvLoadFailurePolicy, KvRole, KvTransport, Role
from pdserve.config.frozen import _Frozen
from pdserve.config.kv_offload import KVOffloadConfig
from pdserve.config.speculative_settings import SpeculativeSettings
from pdserve.errors import ConfigError

# The KV role each service type holds (docs/design.md §1). An explicit kv_role must equal it: a prefill
# node that consumes KV is a contradiction, not a preference.
KV_ROLE_OF_ROLE: dict[Role, KvRole | None] = {
    Role.PREFILL: KvRole.KV_PRODUCER,
    Role.DECODE: KvRole.KV_CONSUMER,
    Role.COLOCATED: KvRole.KV_BOTH,
    Role.ENCODER: None,
}
# Token budget of one step when the file sets none. A prefill node only turns prompts into KV:
# large steps keep the tensor cores busy (H200, Llama-1B shape, 2k-token prompts: 0.545 of the
# bf16 peak at 8,192-16,384 tokens against 0.337 at 2,048, docs/benchmarks.md, "Prefill on the H200"). Every
# other role keeps 2,048, which bounds the inter-token latency of the decodes sharing a step.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
PREFILL_MAX_NUM_BATCHED_TOKENS = 16384
_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")


class FaultsConfig(_Frozen):
    """Test-only fault injection (bench/chaos.py, tests/e2e): every field off by default. Each one
    is acted on by the node; one that cannot apply to the node's role is refused at start."""

    # SIGUSR1 makes the node's engine thread die (as an uncaught device fault would): the node
    # turns NOT_SERVING, fails its in-flight requests and exits with 70.
    engine_death_on_sigusr1: bool = False
    # SIGUSR2 holds the engine thread in one command this long (a wedged step): past the node's
    # step_timeout_s its watchdog turns it NOT_SERVING; 0: off
    engine_stall_on_sigusr2_s: float = Field(default=0.0, ge=0)
    # prefill: every PushKV waits this long right before its KV write (a slow transfer window)
    push_delay_s: float = Field(default=0.0, ge=0)
    # prefill: every Prefill answers this long after its first token is ready (a slow prefill)
    prefill_reply_delay_s: float = Field(default=0.0, ge=0)
    # encoder: every Encode waits this long before encoding (a window to fault "while encoding")
    encode_delay_s: float = Field(default=0.0, ge=0)
    # encoder: every PushEmbeddings waits this long before its write into prefill (a push window)
    ec_push_delay_s: float = Field(default=0.0, ge=0)


class KVOffloadSettings(_Frozen):
    """``kv_offload:``: blocks the prefix cache evicts kept in host memory and/or on local disk
    (pdserve/kvoffload/); a node without the section keeps none."""

    cpu_bytes: int = Field(default=0, ge=0)  # host tier's pool (pinned on CUDA); 0: no host tier
    disk_path: str | None = None  # folder of the disk tier (a per-process folder is made in it)
    disk_bytes: int = Field(default=0, ge=0)  # disk tier's byte budget


class NodeConfig(_Frozen):
    REMOVED_KEYS = {
        "frontend": (
            "decode and colocated nodes serve the router's token streams on their own Steps socket "
            "(TCP frames; its port: frontend_port), the engine thread writing each step's tokens "
            "to it; the front-end process and the Steps streams on the gRPC port are gone"
        ),
    }
    name: str
    role: Role  # service type
    model: str  # checkpoint folder; filled from the file's top-level `model` when omitted
    host: str = "127.0.0.1"  # the address peers and the router dial (not necessarily the bind address)
    grpc_port: int = Field(ge=1, le=65535)
    metrics_port: int = Field(ge=1, le=65535)  # Prometheus /metrics of the node
    # Optional restatement of the role's KV role (KV_ROLE_OF_ROLE); a contradicting one is refused.
    kv_role: KvRole | None = None
    ec_role: EcRole | None = None  # derived by the resolver
    tp: int = 1
    pp: int = 1
    # prefill context parallel ranks: a long prompt chunk's prefill split over this many processes
    # (pdserve/pcp; tp 1 and pp 1 only)
    pcp: int = 1
    # layers per pipeline stage (len pp, sums to the model's layers); None: even split
    pp_layer_split: tuple[int, ...] | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Dtype = Dtype.AUTO
    kv_transport: KvTransport = KvTransport.TCP  # Mooncake TCP / RDMA, or same-host CUDA IPC
    # KV budget (engine/kv_sizing.py): this many bytes; unset: on a GPU gpu_memory_utilization of
    # the device less weights and activations, on a CPU min(4 GiB, half of MemAvailable)
    kv_cache_memory_bytes: int | None = Field(default=None, gt=0)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    max_num_seqs: int = Field(default=64, ge=1)
    # Token budget of one engine step. None: derived from the role by the resolver (prefill
    # PREFILL_MAX_NUM_BATCHED_TOKENS, every other role DEFAULT_MAX_NUM_BATCHED_TOKENS); a value
    # written in the file is kept.
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    # Overload: requests that do not fit wait in the queue; past max_queue_len waiting
    # (admitted, never scheduled) a new one is refused, and one waiting longer than
    # max_queue_wait_s is dropped: both reach the client as the router's 503 (OpenAI error body),
    # holding nothing on any node. None: unbounded.
    max_queue_len: int | None = Field(default=None, ge=1)
    max_queue_wait_s: float | None = Field(default=None, gt=0)
    block_size: int = 16
    kv_load_failure_policy: KvLoadFailurePolicy = KvLoadFailurePolicy.RECOMPUTE  # decode side
    kv_lease_s: float = Field(default=30.0, gt=0)  # prefill side: how long KV waits for its consumer
    kv_ready_timeout_s: float = Field(default=60.0, gt=0)  # prefill: a push waits this long for its KV
    kv_pull_timeout_s: float = Field(default=60.0, gt=0)  # decode: one pull's limit, then the policy
    # decode side: every this many seconds, KeepAlive(transfer_ids) to each prefill node for the
    # requests still queued here, so their leases outlive a long queue (must be < the lease)
    kv_keepalive_s: float | None = Field(default=None, gt=0)  # None: min(5 s, shortest prefill lease / 3)
    kv_checksum: bool = False  # decode: verify a digest of every pulled transfer (kvtransfer/checksum.py)
    max_model_len: int | None = Field(default=None, ge=1)
    enforce_eager: bool = False  # CUDA: no CUDA graphs
    async_scheduling: bool | None = None  # None: on for one CUDA device (EngineConfig.async_scheduling)
    step_timeout_s: float = Field(default=300.0, gt=0)  # a device step taking longer fails its requests
    # Structured outputs: a constraint (JSON schema, regex, grammar) longer than this is refused
    # (the router's own router.max_grammar_bytes refuses it first), and one whose grammar does not
    # compile within grammar_compile_timeout_s is cancelled and its request fails alone.
    max_grammar_bytes: int = Field(default=65536, ge=1)
    grammar_compile_timeout_s: float = Field(default=10.0, gt=0)
    # torch's intra-op CPU threads per engine process (see EngineConfig.cpu_threads); None: half
    # the usable cores on a CPU device, torch's default elsewhere
    cpu_threads: int | None = Field(default=None, ge=1)
    # Speculative decoding on this node (decode / colocated; mtp on the prefill node too): {method:
    # ngram | draft_model | mtp, num_speculative_tokens, prompt_lookup_min / _max (ngram), model
    # (draft_model)}; None: off (pdserve/config/speculative_settings.py)
    speculative: SpeculativeSettings | None = None
    # SIGTERM: stop admitting, finish in-flight work for at most this long, then exit (k8s:
    # terminationGracePeriodSeconds must exceed it, see deploy/k8s).
    drain_timeout_s: float = Field(default=30.0, gt=0)
    # Embedding cache. Encoder: its registered buffer of embeddings and their lease in
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
    kv_offload: KVOffloadSettings | None = None  # evicted KV kept in host memory / on disk; None: off
    allow_missing_mm_embeds: bool = False  # derived, see the resolver
    # Decode / colocated: the port of the node's Steps socket, where the router's token streams
    # come (TCP, length-prefixed frames; services/steps_socket.py); None or 0: any free port (the
    # router learns it from GetLoad). Prefill nodes serve no Steps streams.
    frontend_port: int | None = Field(default=None, ge=0, le=65535)
    # The Steps socket: a connection must send its hello within
    # steps_hello_timeout_s, and at most steps_max_pending_per_peer connections from one peer
    # address wait for theirs (a newer one closes the oldest; services/steps_socket.py).
    steps_hello_timeout_s: float = Field(default=1.0, gt=0, le=1.0)
    steps_max_pending_per_peer: int = Field(default=4, ge=1, le=1024)

    def steps_port(self) -> int | None:
        """The port of this node's Steps socket (0: any free one); None: it serves none (prefill)."""
        return (self.frontend_port or 0) if self.role.decodes else None

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ConfigError(
                f"node name {v!r} is invalid: use letters, digits, '-', '_' and '.', "
                "starting and ending with a letter or digit (it becomes a metric label and a DNS-ish id)"
            )
        return v

    @field_validator("tp", "pp", "pcp")
    @classmethod
    def _check_parallel(cls, v: int, info: Any) -> int:
        if v < 1:
            what = {"tp": "GPUs per pipeline stage", "pp": "pipeline stages"}.get(
                info.field_name, "prefill context parallel ranks"
            )
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
        if "gpu_memory_utilization" in self.model_fields_set and (
            self.device == "cpu" or self.kv_cache_memory_bytes is not None
        ):
            why = "device is cpu" if self.device == "cpu" else "kv_cache_memory_bytes sizes the KV cache"
            raise ConfigError(
                f"node {self.name!r}: gpu_memory_utilization {self.gpu_memory_utilization} is not used "
                f"({why}); remove it"
            )
        steps_keys = {"steps_hello_timeout_s", "steps_max_pending_per_peer"} & self.model_fields_set
        if self.frontend_port is not None:
            steps_keys.add("frontend_port")
        if self.steps_port() is None and (set_keys := sorted(steps_keys)):
            raise ConfigError(
                f"node {self.name!r}: {', '.join(set_keys)} act on the Steps socket (the router's "
                f"token streams) of decode and colocated nodes; a {self.role} node serves none: "
                "remove them"
            )
        expected = KV_ROLE_OF_ROLE[self.role]
        if self.kv_role is not None and self.kv_role != expected:
            fix = f"set kv_role: {expected} or omit it" if expected else "omit kv_role"
            raise ConfigError(
                f"node {self.name!r}: role {self.role} contradicts kv_role {self.kv_role} "
                f"(a {self.role} node holds kv_role {expected}); {fix}"
            )
        for key, acts_on in (("kv_ready_timeout_s", Role.PREFILL), ("kv_pull_timeout_s", Role.DECODE)):
            if key in self.model_fields_set and self.role is not acts_on:
                raise ConfigError(
                    f"node {self.name!r}: {key} acts on {acts_on} nodes only, not on role {self.role}; "
                    "remove it"
                )
        if self.ec_role is EcRole.EC_PRODUCER and self.role is not Role.ENCODER:
            raise ConfigError(
                f"node {self.name!r}: only encoder nodes produce embeddings, but role {self.role} "
                "has ec_role ec_producer; omit ec_role (it is derived) or make the node role: encoder"
            )
        f = self.faults
        if (f.push_delay_s or f.prefill_reply_delay_s) and self.role is not Role.PREFILL:
            raise ConfigError(
                f"node {self.name!r}: faults.push_delay_s / faults.prefill_reply_delay_s act on "
                f"prefill nodes only, not on role {self.role}; remove them"
            )
        if (f.encode_delay_s or f.ec_push_delay_s) and self.role is not Role.ENCODER:
            raise ConfigError(
                f"node {self.name!r}: faults.encode_delay_s / faults.ec_push_delay_s act on "
                f"encoder nodes only, not on role {self.role}; remove them"
            )
        if (f.engine_death_on_sigusr1 or f.engine_stall_on_sigusr2_s) and self.role is Role.ENCODER:
            raise ConfigError(
                f"node {self.name!r}: faults.engine_death_on_sigusr1 / faults.engine_stall_on_sigusr2_s "
                "are not supported on encoder nodes"
            )
        if self.role is Role.ENCODER and self.ec_role is EcRole.EC_CONSUMER:
            raise ConfigError(
                f"node {self.name!r}: an encoder node is an ec_producer, not an ec_consumer; omit ec_role"
            )
        if self.role not in (Role.ENCODER, Role.PREFILL):
            for name in ("max_image_bytes", "max_image_pixels"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"node {self.name!r}: {name} is a setting of the node that decodes images (an "
                        f"encoder, or a prefill node with no encoder in the cluster), but the node's "
                        f"role is {self.role}; move it there"
                    )
        if self.kv_offload is not None:
            if self.role is Role.ENCODER:
                raise ConfigError(
                    f"node {self.name!r}: kv_offload acts on engine nodes, not encoders; remove it"
                )
            self.kv_offload_config()  # its own checks (a tier set, disk_path with disk_bytes)
        if self.pcp != 1 and (
            self.tp != 1 or self.pp != 1 or self.role not in (Role.PREFILL, Role.COLOCATED)
        ):
            # decode: pulled KV lands in rank 0's cache only, which a later split prefill would miss
            raise ConfigError(
                f"node {self.name!r}: pcp {self.pcp} runs on prefill and colocated nodes with tp 1 and "
                f"pp 1 only (got role {self.role}, tp {self.tp}, pp {self.pp}); set pcp: 1"
            )
        if self.role is Role.ENCODER:
            if self.tp != 1 or self.pp != 1:
                raise ConfigError(
                    f"node {self.name!r}: an encoder runs on one device (tp 1, pp 1), got tp {self.tp}, "
                    f"pp {self.pp}; add encoder nodes to scale out instead"
                )
            if not self.kv_transport.is_mooncake:
                raise ConfigError(
                    f"node {self.name!r}: embeddings move over Mooncake (kv_transport tcp or rdma), "
                    "not cuda_ipc; set kv_transport: tcp"
                )
        return self

    def kv_offload_config(self) -> KVOffloadConfig | None:
        o = self.kv_offload
        if o is None:
            return None
        try:
            return KVOffloadConfig(cpu_bytes=o.cpu_bytes, disk_path=o.disk_path, disk_bytes=o.disk_bytes)
        except ConfigError as e:
            raise ConfigError(f"node {self.name!r}: {e}") from None

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_address(self) -> str:
        return f"{self.host}:{self.metrics_port}"
