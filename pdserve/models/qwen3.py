"""Qwen3 decoder: Llama plus per-head RMSNorm of q and k (over head_dim, before RoPE).

head_dim is explicit in config.json (it need not be hidden_size / num_heads); no q/k/v bias
unless attention_bias says so.
"""

from __future__ import annotations

import torch

from pdserve.models.config import ModelArchConfig
from pdserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, RMSNorm


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [n, H, D], k: [n, Hkv, D]; the norm runs over the last dim, per head.
        return self.q_norm(q), self.k_norm(k)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3DecoderLayer
