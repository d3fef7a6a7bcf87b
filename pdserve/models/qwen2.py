"""Qwen2 decoder: Llama with bias on q/k/v (never on o), whatever config.json says."""

from __future__ import annotations

from pdserve.models.config import ModelArchConfig
from pdserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def bias_flags(cfg: ModelArchConfig) -> tuple[bool, bool]:
        return True, False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen2DecoderLayer
