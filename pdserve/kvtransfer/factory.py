"""Picks the KV data plane by the node's ``kv_transport`` setting."""

from __future__ import annotations

from pdserve.errors import ConfigError
from pdserve.kvtransfer.backend import MooncakeBackend, TransferBackend

KV_TRANSPORTS = ("tcp", "rdma", "cuda_ipc")


def make_backend(kv_transport: str, host: str, device: str) -> TransferBackend:
    """``tcp`` / ``rdma``: Mooncake Transfer Engine; ``cuda_ipc``: same-host GPU copies.

    ``device`` is the engine's resolved device ("cpu", "cuda", "cuda:N"): cuda_ipc moves GPU
    memory only, so a CPU node asking for it is refused here, at start.
    """
    if kv_transport in ("tcp", "rdma"):
        return MooncakeBackend(host=host, protocol=kv_transport)
    if kv_transport == "cuda_ipc":
        if not device.startswith("cuda"):
            raise ConfigError(
                f"kv_transport 'cuda_ipc' needs the KV cache on a CUDA device, but this node runs on "
                f"{device!r}; use kv_transport 'tcp' (or 'rdma') for CPU nodes"
            )
        from pdserve.kvtransfer.cuda_ipc import CudaIpcBackend  # ctypes over libcudart: CUDA nodes only

        _, _, index = device.partition(":")
        return CudaIpcBackend(host=host, device=int(index) if index else None)
    raise ConfigError(f"unknown kv_transport {kv_transport!r}; supported: {', '.join(KV_TRANSPORTS)}")
