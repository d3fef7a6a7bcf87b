"""Which attention path a runner takes, and the Triton implementation behind one of them.

Two implementations, picked once per runner by ``select_attention_backend`` (the one predicate,
``triton_attention_unsupported_reason``, of what the Triton kernels can compute) and carried in
``AttentionMetadata.backend``, so metadata building and execution agree:

    kernels backend   device          -> attention path
    ---------------   -------------   --------------------------------------------------------
    auto              CPU             torch (gather the context, SDPA)
    auto              CUDA            Triton (pdserve.kernels.triton_attention); unsupported: raise
                                      (prefill steps of fresh prompts: cuDNN, cudnn_prefill.py;
                                      small prefill steps: FA2 varlen, flash_prefill.py)
    triton            any             Triton (CPU needs TRITON_INTERPRET=1); unsupported: raise
    torch             any             torch

Called by the model runner and the drafters (``select_attention_backend``); the ``triton_*impl``
getters by kv_store.py (the KV write) and paged_attention.py (the attention launch and its
split count), which take the Triton path.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

from pdserve import kernels
from pdserve.errors import UnsupportedError
from pdserve.models.attention import AttentionBackend

TRITON_ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_triton_modules: dict[str, ModuleType] = {}  # name -> the pdserve.kernels module, once imported


def triton_attention_unsupported_reason(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> str | None:
    """Why the Triton attention kernels cannot compute this case, or None if they can."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"device {device} needs CUDA, or TRITON_INTERPRET=1 set before importing triton"
    if dtype not in TRITON_ATTENTION_DTYPES:
        return f"dtype {dtype} is not one of fp16/bf16/fp32"
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"{num_heads} query heads do not split evenly over {num_kv_heads} KV heads"
    if num_heads // num_kv_heads > 64:
        return f"{num_heads // num_kv_heads} query heads per KV head exceed 64 (one tile)"
    if not 0 < head_dim <= 256:
        return f"head_dim {head_dim} is outside 1..256"
    return None


def select_attention_backend(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> AttentionBackend:
    """The attention path for a runner, following the process-wide ``pdserve.kernels`` backend."""
    backend = kernels.get_backend()
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return "torch"
    reason = triton_attention_unsupported_reason(device, dtype, num_heads, num_kv_heads, head_dim)
    if reason is not None:
        raise UnsupportedError(
            f"no Triton paged-attention kernel for {num_heads} heads / {num_kv_heads} KV heads, "
            f"head_dim {head_dim}, {dtype} on {device}: {reason}; use the torch backend "
            "(pdserve.kernels.set_backend('torch')) or a supported model/dtype"
        )
    return "triton"


def triton_module(name: str) -> ModuleType:
    """``pdserve.kernels.<name>``, a Triton kernel module, imported on first use (importing it
    imports triton, which CPU-only paths never need)."""
    mod = _triton_modules.get(name)
    if mod is None:
        mod = _triton_modules[name] = importlib.import_module(f"pdserve.kernels.{name}")
    return mod


def triton_impl() -> ModuleType:
    """``pdserve.kernels.triton_attention``: the paged attention kernel's launcher."""
    return triton_module("triton_attention")


def triton_kv_write_impl() -> ModuleType:
    """``pdserve.kernels.triton_kv_write``: the KV cache write."""
    return triton_module("triton_kv_write")


def triton_kv_splits_impl() -> ModuleType:
    """``pdserve.kernels.triton_kv_splits``: the split count and the SM count."""
    return triton_module("triton_kv_splits")
