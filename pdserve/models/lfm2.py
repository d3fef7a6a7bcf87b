"""LFM2 (transformers' ``Lfm2ForCausalLM``): short depthwise convolutions beside attention.

    per layer      operator_norm -> (attention | short conv) -> + residual
                   ffn_norm -> w2(silu(w1 x) * w3 x) -> + residual
    attention      q_layernorm / k_layernorm per head before RoPE, scale head_dim ** -0.5, full
    short conv     B, C, x = in_proj(h); y = C * causal_conv_K(B * x); out_proj(y)
                   (depthwise, kernel K = conv_L_cache: position p mixes the inputs B * x of
                   positions p - K + 1 .. p, those before 0 being zero)
    final norm     model.embedding_norm; lm_head tied to the embedding by default

The convolution's state is the inputs B * x of the last K - 1 positions. They are kept per
position in a KV cache group of their own (engine/kv_cache_groups.py, SHORT_CONV), a table of
blocks like the attention's: each step writes its tokens' inputs at their slots, then every
token reads its K positions through the group's block table. The group is a window of K tokens
(its older blocks are freed as the request advances), and a prefix hit resumes it at a block
boundary like any group. One process only: no tensor parallelism or pipeline stages.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.parallel_state import tp_size
from pdserve.errors import ConfigError
from pdserve.kernels.backend import small_to_device
from pdserve.models.attention import AttentionMetadata
from pdserve.models.config import IntermediateTensors, ModelArchConfig
from pdserve.models.kv_store import rotary_and_store_kv
from pdserve.models.llama import LlamaForCausalLM, RotaryEmbedding, VocabEmbedding
from pdserve.models.paged_attention import attend_cached


class Lfm2RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Lfm2MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w3 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Lfm2Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_layernorm = Lfm2RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_layernorm = Lfm2RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        q = self.q_layernorm(self.q_proj(hidden).view(n, self.num_heads, self.head_dim))  # [n, H, D]
        k = self.k_layernorm(self.k_proj(hidden).view(n, self.num_kv_heads, self.head_dim))  # [n, Hkv, D]
        v = self.v_proj(hidden).view(n, self.num_kv_heads, self.head_dim)
        q = rotary_and_store_kv(q, k, v, positions, cos_sin, kv_cache, meta)
        out = attend_cached(q, kv_cache, meta, self.scale)
        return self.out_proj(out.reshape(n, self.num_heads * self.head_dim))  # [n, hidden]


ConvIndex = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # block ids, offsets, valid: [n, K] each


def conv_index(meta: AttentionMetadata, positions: torch.Tensor, kernel: int) -> ConvIndex:
    """Where each token's K inputs live in the convolution group's cache (one step, all layers):
    token t at position p reads positions p - K + 1 .. p of its request, through its table."""
    device = positions.device
    qlens = small_to_device(meta.query_lens_cpu, torch.long, device)
    rows = torch.repeat_interleave(
        torch.arange(len(meta.query_lens_cpu), device=device), qlens, output_size=positions.shape[0]
    )  # [n]; output_size given: no wait for the device to count it
    pos = positions[:, None] - (kernel - 1) + torch.arange(kernel, device=device)  # [n, K]
    valid = pos >= 0
    pos = pos.clamp(min=0)
    bs = meta.block_size
    blocks = meta.block_tables[rows[:, None], pos // bs].long()  # [n, K]
    return blocks, pos % bs, valid


class Lfm2ShortConv(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        assert cfg.conv_kernel_size is not None
        h = cfg.hidden_size
        self.kernel = cfg.conv_kernel_size
        # names as the checkpoint's: conv.conv.weight [h, 1, K], conv.in_proj, conv.out_proj
        self.conv = nn.Conv1d(h, h, self.kernel, groups=h, bias=cfg.conv_bias, padding=self.kernel - 1)
        self.in_proj = nn.Linear(h, 3 * h, bias=cfg.conv_bias)
        self.out_proj = nn.Linear(h, h, bias=cfg.conv_bias)

    def forward(
        self, hidden: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, index: ConvIndex
    ) -> torch.Tensor:
        """hidden [n, h]; cache: this layer's view of the group's [num_blocks, block_size, h]."""
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)  # [n, h] each
        bx = b * x
        keep = meta.slot_mapping >= 0
        slots = meta.slot_mapping[keep]
        cache[slots // meta.block_size, slots % meta.block_size] = bx[keep]  # this step's inputs
        blocks, offsets, valid = index
        window = cache[blocks, offsets] * valid[..., None]  # [n, K, h]: zeros before position 0
        conv = torch.einsum("nkh,hk->nh", window.float(), self.conv.weight[:, 0, :].float()).to(bx.dtype)
        if self.conv.bias is not None:
            conv = conv + self.conv.bias
        return self.out_proj(c * conv)  # [n, h]


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.is_attention = cfg.layer_types[layer_idx] == "full_attention"
        if self.is_attention:
            self.self_attn = Lfm2Attention(cfg)
        else:
            self.conv = Lfm2ShortConv(cfg)
        self.feed_forward = Lfm2MLP(cfg)
        self.operator_norm = Lfm2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = Lfm2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Lfm2Model(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): Lfm2DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)})
        self.embedding_norm = Lfm2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)


class Lfm2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelArchConfig, layer_start: int = 0, layer_end: int | None = None) -> None:
        nn.Module.__init__(self)
        layer_end = cfg.num_hidden_layers if layer_end is None else layer_end
        if layer_start != 0 or layer_end != cfg.num_hidden_layers or tp_size() > 1:
            raise ConfigError(
                "LFM2 runs in one process (its convolution state group needs a block table per KV "
                "group): use pipeline_parallel_size 1 and tensor_parallel_size 1"
            )
        self.cfg = cfg
        self.tp_size, self.tp_rank = 1, 0
        self.layer_start, self.layer_end = 0, layer_end
        self.is_first_stage = self.is_last_stage = True
        self.layer_names = [f"model.layers.{i}.self_attn" for i in range(layer_end)]
        self.model = Lfm2Model(cfg)  # type: ignore[assignment]
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # type: ignore[assignment]
        self.tie_weights()

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [n]
        positions: torch.Tensor,  # [n]
        kv_caches: list[torch.Tensor],  # one view per layer: KV, or a convolution's inputs
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        m: Lfm2Model = self.model  # type: ignore[assignment]
        if inputs_embeds is None:
            assert input_ids is not None
            inputs_embeds = m.embed_tokens(input_ids)  # [n, hidden]
        hidden = inputs_embeds
        cos_sin = m.rotary_emb.cos_sin_cache(positions.device)
        index: ConvIndex | None = None
        for i, (layer, cache) in enumerate(zip(m.layers.values(), kv_caches, strict=True)):
            assert isinstance(layer, Lfm2DecoderLayer)
            layer_meta = meta.for_layer(i)
            h = layer.operator_norm(hidden)
            if layer.is_attention:
                h = layer.self_attn(h, positions, cos_sin, cache, layer_meta)
            else:
                if index is None:  # the same for every convolution layer of the step
                    index = conv_index(layer_meta, positions, layer.conv.kernel)
                h = layer.conv(h, cache, layer_meta, index)
            hidden = hidden + h
            hidden = hidden + layer.feed_forward(layer.ffn_norm(hidden))
        return m.embedding_norm(hidden)  # [n, hidden]

    # ---- weights: the checkpoint's names are the modules' names ---------------------------

    def needs_weight(self, name: str) -> bool:
        return not (name.startswith("lm_head.") and self.cfg.tie_word_embeddings)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.tie_weights()
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if not self.needs_weight(name):
                continue
            dst = self._param(params, name, name).data
            self._check_shape(name, dst, tensor)
            dst.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ConfigError(f"checkpoint lacks {len(missing)} weights LFM2 needs, e.g. {missing[:3]}")
