"""Decode steps of a few rows through the fused Triton GEMV (``kernels/triton_gemv.py``).

A Llama-family decoder layer at batch 1-8 on a GPU is ~10 short kernels, and at batch 1 the
fixed cost of each launch, not the weight bytes, is most of the step. Here one layer runs as

    qkv      = GEMV(rmsnorm(hidden + residual))      the input norm fused, new residual written
    attn     = RoPE + KV store + paged attention      as in ``LlamaAttention.attend_qkv``
    o        = o_proj(attn)
    gate_up  = GEMV(rmsnorm(o + residual))           the post-attention norm fused
    out      = GEMV(silu(gate) * up)                 the activation fused into down_proj

three kernels fewer a layer, and the GEMMs of these row counts in the Triton kernel instead of
cuBLAS (docs/benchmarks.md, "GPU decode throughput", has both measured on an H100).

It applies to a layer only when the result is the same computation: a CUDA bf16 / fp16 step of
at most ``triton_gemv.MAX_ROWS`` rows, not the first layer (its input norm has no residual),
tensor parallel size 1 (row-parallel layers all-reduce), the plain ``RMSNorm`` and ``LlamaMLP``
(MoE layers and other norms keep their path), and no LoRA adapter on the three projections.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from pdserve.distributed.parallel_state import tp_size

if TYPE_CHECKING:
    from pdserve.models.attention import AttentionMetadata
    from pdserve.models.linear import Linear
    from pdserve.models.llama import LlamaDecoderLayer, RMSNorm

# PDSERVE_FUSED_DECODE=1 turns the path on (benchmarks compare both); off by default until the
# GPU measurements in docs/benchmarks.md show it faster on the card.
ENABLED = os.environ.get("PDSERVE_FUSED_DECODE", "0") == "1"
DEVICE_TYPES: tuple[str, ...] = ("cuda",)
DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)


def _structure_ok(layer: LlamaDecoderLayer) -> bool:
    """Cached on the layer: the modules are the ones this path reproduces."""
    ok = getattr(layer, "_fused_decode_ok", None)
    if ok is None:
        from pdserve.models.llama import LlamaMLP, RMSNorm

        ok = (
            type(layer.mlp) is LlamaMLP
            and type(layer.input_layernorm) is RMSNorm
            and type(layer.post_attention_layernorm) is RMSNorm
            and layer.self_attn.o_proj.bias is None
        )
        object.__setattr__(layer, "_fused_decode_ok", ok)  # a plain attribute, not a submodule
    return bool(ok)


def applies(layer: LlamaDecoderLayer, hidden: torch.Tensor) -> bool:
    """Whether ``layer`` runs this step's ``hidden`` [n, hidden] through the fused path."""
    if not ENABLED or hidden.device.type not in DEVICE_TYPES or hidden.dtype not in DTYPES:
        return False
    from pdserve.kernels.triton_gemv import MAX_ROWS

    if hidden.shape[0] > MAX_ROWS or tp_size() != 1 or not _structure_ok(layer):
        return False
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj.lora is None and mlp.gate_up_proj.lora is None and mlp.down_proj.lora is None


def layer_forward(
    layer: LlamaDecoderLayer,
    hidden: torch.Tensor,
    residual: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``LlamaDecoderLayer.forward`` for a step ``applies`` accepted -> (mlp output, residual)."""
    from pdserve.kernels.triton_gemv import gemv

    attn, mlp = layer.self_attn, layer.mlp
    qkv, residual = _norm_then(attn.qkv_proj, layer.input_layernorm, hidden, residual)
    o = attn.o_proj(attn.attend_qkv(qkv, positions, cos_sin_cache, kv_cache, meta))
    gate_up, residual = _norm_then(mlp.gate_up_proj, layer.post_attention_layernorm, o, residual)
    out, _ = gemv(gate_up, mlp.down_proj.weight, mlp.down_proj.bias, silu_mul=True)
    return out, residual


def _norm_then(
    linear: Linear, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """linear(norm(x + residual)) in one launch -> (its output, x + residual)."""
    from pdserve.kernels.triton_gemv import gemv

    y, new_residual = gemv(
        x, linear.weight, linear.bias, residual=residual, norm_weight=norm.weight, eps=norm.eps
    )
    assert new_residual is not None
    return y, new_residual
