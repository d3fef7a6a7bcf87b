"""Gemma-3 text decoder: sliding-window and full-attention layers interleaved per ``layer_types``.

Differences from Llama (transformers' ``Gemma3ForCausalLM``):

    embeddings      scaled by sqrt(hidden_size) (in the weights' dtype)
    RMSNorm         x * rsqrt(mean(x^2) + eps) * (1 + w), computed in fp32, then cast
    per layer       input norm -> attention -> post-attention norm -> + residual
                    pre-FFN norm -> MLP (gelu_tanh(gate) * up) -> post-FFN norm -> + residual
    attention       q_norm / k_norm per head before RoPE; scale query_pre_attn_scalar ** -0.5;
                    sliding layers: RoPE of ``rope_local``, keys of the last ``sliding_window``
                    positions only; full layers: ``rope``, every key
    logits          tanh soft cap when final_logit_softcapping is set

The sliding layers form one KV cache group and the full layers another
(engine/kv_cache_groups.py). Where each group has its own block table (engine/kv_group_tables.py:
a single-process engine without kv_offload; prefill -> decode moves each group's blocks) a sliding layer's
table holds only the blocks its window still sees, and ``meta.for_layer(i)`` gives each layer
its group's table; elsewhere every layer keeps the whole sequence in one table and a sliding
layer reads the window of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.models.attention import AttentionMetadata
from pdserve.models.attention_torch import attend_cached_window
from pdserve.models.config import IntermediateTensors, ModelArchConfig
from pdserve.models.kv_store import rotary_and_store_kv
from pdserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, RotaryEmbedding, row_parallel
from pdserve.models.paged_attention import attend_cached


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class Gemma3MLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [n, I/tp] each
        return row_parallel(self.down_proj, F.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(LlamaAttention):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        assert cfg.query_pre_attn_scalar is not None
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.window = cfg.sliding_window if cfg.layer_types[layer_idx] == "sliding_attention" else None
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [n, hidden]
        positions: torch.Tensor,  # [n]
        cos_sin_cache: torch.Tensor,  # [max_positions, D] fp32: this layer type's RoPE
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim))  # [n, H/tp, D]
        k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim))  # [n, Hkv/tp, D]
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        q = rotary_and_store_kv(q, k, v, positions, cos_sin_cache, kv_cache, meta)
        if self.window is None:
            out = attend_cached(q, kv_cache, meta, self.scale)
        else:
            out = attend_cached_window(q, kv_cache, meta, self.scale, self.window)
        return row_parallel(self.o_proj, out.reshape(n, self.q_size))  # [n, hidden]


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(cfg, layer_idx)
        self.mlp = Gemma3MLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [n, hidden]: the residual stream
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), positions, cos_sin_cache, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Gemma3DecoderLayer  # type: ignore[assignment]

    def __init__(self, cfg: ModelArchConfig, layer_start: int = 0, layer_end: int | None = None) -> None:
        super().__init__(cfg, layer_start, layer_end)
        m = self.model
        if m.norm is not None:
            m.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # type: ignore[assignment]
        assert cfg.rope_local is not None
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.rope_local, cfg.max_position_embeddings)
        self.tie_weights()

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [n]
        positions: torch.Tensor,  # [n]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        assert len(kv_caches) == len(self.model.layers)
        if self.is_first_stage:
            if inputs_embeds is None:
                assert input_ids is not None and self.model.embed_tokens is not None
                emb = self.model.embed_tokens(input_ids)  # [n, hidden]
                inputs_embeds = emb * torch.tensor(self.cfg.hidden_size**0.5, dtype=emb.dtype)
            hidden = inputs_embeds
        else:
            assert intermediate is not None, "a later pipeline stage needs the previous stage's tensors"
            hidden = intermediate.hidden_states
        full = self.model.rotary_emb.cos_sin_cache(positions.device)
        local = self.rotary_local.cos_sin_cache(positions.device)
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers.values(), kv_caches, strict=True)):
            assert isinstance(layer, Gemma3DecoderLayer)
            cos_sin = full if layer.self_attn.window is None else local
            hidden = layer(hidden, positions, cos_sin, kv_cache, meta.for_layer(i))
        if not self.is_last_stage:
            return IntermediateTensors(hidden, torch.zeros_like(hidden))
        assert self.model.norm is not None
        return self.model.norm(hidden)  # type: ignore[return-value]

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = super().compute_logits(hidden, upcast=True)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
