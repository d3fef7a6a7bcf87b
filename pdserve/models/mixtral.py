"""Mixtral decoder: Llama attention, and in every layer a sparse MoE block (fused_moe_block.py)
whose router softmaxes the top-k logits (renormalised top-k of the softmax: the same weights)."""

from __future__ import annotations

from pdserve.models.config import ModelArchConfig
from pdserve.models.fused_moe_block import MoEForCausalLM, use_moe_mlp
from pdserve.models.llama import LlamaDecoderLayer


class MixtralDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        use_moe_mlp(self, cfg, layer_idx)


class MixtralForCausalLM(MoEForCausalLM):
    decoder_layer_cls = MixtralDecoderLayer
