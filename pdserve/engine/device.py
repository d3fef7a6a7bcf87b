"""Where an engine process runs: its torch device (TP rank r on CUDA takes GPU r), the weights'
dtype, and its CPU threads.

ModelRunner resolves its device and dtype here; the encoder node (services/encoder) does the
same for its vision model; LLMEngine and every worker process (engine/workers.py,
pcp/worker.py, pcp/runner.py) set their intra-op threads.
"""

from __future__ import annotations

import torch

from pdserve.config.engine import EngineConfig
from pdserve.distributed.parallel_state import tp_rank, tp_size
from pdserve.errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def set_intra_op_threads(config: EngineConfig, processes: int = 1) -> None:
    """Apply ``config.cpu_threads`` (auto: see ``EngineConfig.intra_op_threads``) to this
    process, one of the engine's ``processes`` on the host."""
    n = config.intra_op_threads(resolve_device(config.device).type == "cpu", processes)
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)


def resolve_device(device: str) -> torch.device:
    """The device of this process; TP rank r on CUDA takes GPU r (``cuda:N``: GPU N + r)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available; use device='cpu'")
    if dev.type == "cuda" and tp_size() > 1:
        index = (dev.index or 0) + tp_rank()
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"TP rank {tp_rank()} needs GPU {index} but {torch.cuda.device_count()} are visible; "
                "lower tensor_parallel_size or expose more GPUs"
            )
        dev = torch.device("cuda", index)
        torch.cuda.set_device(dev)
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]
