"""The closed sets of values in the cluster file, as enums.

Each is a :class:`~enum.StrEnum`: the file writes the value (``role: prefill``), pydantic
turns it into the member at load and refuses anything else there, and the code downstream
compares members (``spec.role is Role.PREFILL``), never strings.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """A node's service type."""

    PREFILL = "prefill"
    DECODE = "decode"
    ENCODER = "encoder"
    COLOCATED = "colocated"

    @property
    def decodes(self) -> bool:
        """A decode-capable node: it runs requests to their end and serves the router's tokens."""
        return self in (Role.DECODE, Role.COLOCATED)

    @property
    def moves_kv(self) -> bool:
        """A node with a KV transfer engine: prefill pushes KV out of it, decode pulls KV into it."""
        return self in (Role.PREFILL, Role.DECODE)


class KvRole(StrEnum):
    """The KV role a node holds; it follows from the role (``KV_ROLE_OF_ROLE``)."""

    KV_PRODUCER = "kv_producer"
    KV_CONSUMER = "kv_consumer"
    KV_BOTH = "kv_both"


class EcRole(StrEnum):
    """The embedding-cache role a node holds (derived by the resolver)."""

    EC_PRODUCER = "ec_producer"
    EC_CONSUMER = "ec_consumer"


class KvTransport(StrEnum):
    """How KV (and embeddings) move between nodes."""

    TCP = "tcp"  # Mooncake over TCP
    RDMA = "rdma"  # Mooncake over RDMA
    CUDA_IPC = "cuda_ipc"  # same-host GPUs

    @property
    def is_mooncake(self) -> bool:
        return self in (KvTransport.TCP, KvTransport.RDMA)


class KvLoadFailurePolicy(StrEnum):
    """What decode does when a KV pull fails (pdserve/kvtransfer/load_policy.py)."""

    FAIL = "fail"  # the request ends with an error
    RECOMPUTE = "recompute"  # decode prefills the prompt itself
    REPREFILL = "reprefill"  # the router asks another prefill node for the KV


class Dtype(StrEnum):
    """The weights' and activations' dtype; auto: bfloat16 on CUDA, float32 on a CPU."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
