"""Qwen3-MoE decoder: Qwen3 attention (per-head q/k RMSNorm), a sparse MoE block in the layers
``moe.sparse_layers`` names (the others keep the dense MLP of ``intermediate_size``); the router's
top-k weights are renormalised only with ``norm_topk_prob``."""

from __future__ import annotations

from pdserve.models.config import ModelArchConfig
from pdserve.models.fused_moe_block import MoEForCausalLM, use_moe_mlp
from pdserve.models.qwen3 import Qwen3DecoderLayer


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        use_moe_mlp(self, cfg, layer_idx)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    decoder_layer_cls = Qwen3MoeDecoderLayer
