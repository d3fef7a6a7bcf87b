"""What a node with ``pcp`` > 1 is refused at start, before any rank process starts.

tp > 1 and pp > 1 are refused by ``ParallelConfig`` itself; the rest needs the whole engine
config or the checkpoint.
"""

from __future__ import annotations

import dataclasses

import torch

from pdserve.config.engine import EngineConfig
from pdserve.errors import ConfigError
from pdserve.models.config import ModelArchConfig


def check_pcp_config(config: EngineConfig) -> None:
    """ConfigError naming the value and the fix for what PCP ranks cannot run."""
    pcp = config.parallel.prefill_context_parallel_size
    name = f"pcp (prefill_context_parallel_size) {pcp}"
    if config.lora is not None:
        raise ConfigError(f"{name} with lora is not supported (adapters load on rank 0 only); use pcp 1")
    if config.kv_offload is not None:
        raise ConfigError(
            f"{name} with kv_offload is not supported (rank 0's tier would load blocks the other "
            "ranks lack); remove kv_offload or use pcp 1"
        )
    if config.async_scheduling:
        raise ConfigError(
            f"{name} with async_scheduling true is not supported (PCP steps run synchronously); "
            "leave async_scheduling unset or false"
        )
    arch = ModelArchConfig.from_model_dir(config.model)
    other = sorted({t for t in arch.layer_types if t != "full_attention"})
    if other:
        raise ConfigError(
            f"{name}: model {config.model} has {', '.join(other)} layers; prefill context "
            "parallelism splits full-attention models only (layer_types all full_attention); use pcp 1"
        )
    device = rank_device(config.device, 0)
    if device.type == "cuda":
        last = (device.index or 0) + pcp - 1
        if last >= torch.cuda.device_count():
            raise ConfigError(
                f"{name} on {config.device}: rank {pcp - 1} needs GPU {last} but "
                f"{torch.cuda.device_count()} are visible; lower pcp or expose more GPUs"
            )


def rank_device(device: str, rank: int) -> torch.device:
    """The device of PCP rank ``rank`` (``device`` as in EngineConfig): the CPU for every rank,
    or on CUDA the GPU after the configured one by ``rank`` (``cuda:N``: GPU N + rank)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """``config`` for PCP rank ``rank``: its own device (rank_device)."""
    dev = rank_device(config.device, rank)
    return dataclasses.replace(config, device=str(dev)) if dev.type == "cuda" else config
