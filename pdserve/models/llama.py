"""Llama decoder (also the base of Qwen2 / Qwen3), one pipeline stage of it.

A stage holds decoder layers [layer_start, layer_end). Parameter names follow the HF checkpoint
(``model.layers.{i}...`` with the global layer index) except two fused projections:

    qkv_proj     = cat(q_proj, k_proj, v_proj)   rows: [H*D | Hkv*D | Hkv*D]
    gate_up_proj = cat(gate_proj, up_proj)       rows: [I | I]

Tensor parallelism (``pdserve.distributed.parallel_state``, read once at construction): with
TP ranks, each rank holds H/tp query heads, Hkv/tp KV heads and I/tp MLP rows (Megatron layout):

    qkv_proj, gate_up_proj   column-parallel: each component's rows sliced, rank r takes share r
    o_proj, down_proj        row-parallel: input columns sliced; partial sums all-reduced, then
                             the (replicated) bias is added once
    embed_tokens, lm_head,   replicated: every rank computes the full logits and samples the same
    norms                    token, so no gather is needed (costs vocab x hidden per rank)
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.parallel_state import all_reduce, tp_rank, tp_size
from pdserve.errors import ConfigError
from pdserve.kernels import fused_add_rms_norm, rms_norm, rotary_cos_sin_cache, silu_and_mul
from pdserve.models import cudnn_prefill
from pdserve.models.attention import AttentionMetadata
from pdserve.models.config import IntermediateTensors, ModelArchConfig, RopeConfig
from pdserve.models.kv_store import rotary_and_store_kv
from pdserve.models.linear import Linear
from pdserve.models.paged_attention import attend_cached

# HF weight name piece -> (our fused parameter piece, shard id)
STACKED_PARAMS: dict[str, tuple[str, str]] = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", "gate"),
    ".up_proj.": (".gate_up_proj.", "up"),
}


def check_tp_divisible(cfg: ModelArchConfig, tp: int) -> None:
    """ConfigError unless ``tp`` splits the heads, KV heads and MLP rows evenly."""
    sizes = {
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "intermediate_size": cfg.intermediate_size,
    }
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        g = math.gcd(*sizes.values())
        ok = [d for d in range(1, min(g, 8) + 1) if g % d == 0]
        raise ConfigError(
            f"tensor_parallel_size={tp} does not divide the model's "
            + ", ".join(f"{k}={v}" for k, v in bad.items())
            + f"; use a tensor_parallel_size that divides {', '.join(f'{k}={v}' for k, v in sizes.items())} "
            f"(e.g. one of {ok})"
        )


def row_parallel(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear`` whose input columns are sharded over the TP ranks: sum of partials, bias once."""
    if tp_size() == 1:
        return linear(x)  # the TP 1 path stays bit-identical to a plain nn.Linear
    out = all_reduce(F.linear(x, linear.weight))
    return out if linear.bias is None else out + linear.bias


class RMSNorm(nn.Module):
    """Weight holder around ``pdserve.kernels``; with a residual it is the fused add + norm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate_half): a cos/sin cache of every position, built once per device.

    The cache ([max_positions, head_dim] fp32, see ``pdserve.kernels.rotary``) is made on the
    first forward on a device, i.e. in the engine's warm-up before any CUDA graph capture.
    """

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.max_positions = max_positions
        # A plain attribute, not a buffer: the model may be built on the meta device and
        # materialised with to_empty(), which would leave a buffer uninitialised.
        self._cache: torch.Tensor | None = None

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """[max_positions, head_dim] fp32 on ``device``: cos | sin of position * inv_freq."""
        if self._cache is None or self._cache.device != device:
            inv_freq = self.rope.inv_freq(self.head_dim).to(device)  # [D/2] fp32
            self._cache = rotary_cos_sin_cache(inv_freq, self.max_positions)
        return self._cache


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        check_tp_divisible(cfg, tp_size())
        self.intermediate_size = cfg.intermediate_size // tp_size()  # this rank's share
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(self.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [n, 2I/tp] -> [n, I/tp] -> [n, hidden] (all-reduced over TP ranks)
        return row_parallel(self.down_proj, silu_and_mul(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        check_tp_divisible(cfg, tp_size())
        self.num_heads = cfg.num_attention_heads // tp_size()  # this TP rank's heads
        self.num_kv_heads = cfg.num_key_value_heads // tp_size()
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        qkv_bias, o_bias = self.bias_flags(cfg)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_bias)

    @staticmethod
    def bias_flags(cfg: ModelArchConfig) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o)."""
        return cfg.attention_bias, cfg.attention_bias

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook applied to per-head q/k before RoPE; Llama has none."""
        return q, k

    def forward(
        self,
        hidden: torch.Tensor,  # [n, hidden]
        positions: torch.Tensor,  # [n]
        cos_sin_cache: torch.Tensor,  # [max_positions, D] fp32
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)  # [n, H/tp, D]
        k = k.view(n, self.num_kv_heads, self.head_dim)  # [n, Hkv/tp, D]
        v = v.view(n, self.num_kv_heads, self.head_dim)  # [n, Hkv/tp, D]
        q, k = self.qk_norm(q, k)  # before RoPE (Qwen3)
        k_out = cudnn_prefill.key_buffer(q, k, meta)  # the rotated keys too, for cuDNN prefill steps
        q = rotary_and_store_kv(q, k, v, positions, cos_sin_cache, kv_cache, meta, k_out)  # rotated q
        out = attend_cached(q, kv_cache, meta, self.scale, k_out, v if k_out is not None else None)
        return row_parallel(self.o_proj, out.reshape(n, self.q_size))  # [n, hidden]


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, cfg: ModelArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [n, hidden]
        residual: torch.Tensor | None,  # [n, hidden]; None before the first layer
        positions: torch.Tensor,  # [n]
        cos_sin_cache: torch.Tensor,  # [max_positions, D] fp32
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is deferred into the next norm (vLLM style): the stream is
        # residual + hidden, and each norm fuses the add.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, cos_sin_cache, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class VocabEmbedding(nn.Embedding):
    """``nn.Embedding`` (same parameter) whose weight on the meta device is left uninitialized:
    ``models/loader.py`` builds there before loading the checkpoint, and ``normal_`` on a meta
    tensor imports ``torch._dynamo`` (~1.2 s of CPU in every node and worker process's start)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class LlamaModel(nn.Module):
    def __init__(
        self, cfg: ModelArchConfig, layer_start: int, layer_end: int, layer_cls: type[LlamaDecoderLayer]
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size) if layer_start == 0 else None
        # Keyed by the global index so parameter names match the checkpoint's.
        self.layers = nn.ModuleDict({str(i): layer_cls(cfg, i) for i in range(layer_start, layer_end)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if layer_end == cfg.num_hidden_layers else None
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)


class LlamaForCausalLM(nn.Module):
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, cfg: ModelArchConfig, layer_start: int = 0, layer_end: int | None = None) -> None:
        super().__init__()
        layer_end = cfg.num_hidden_layers if layer_end is None else layer_end
        if not 0 <= layer_start < layer_end <= cfg.num_hidden_layers:
            raise ConfigError(
                f"pipeline stage layers [{layer_start}, {layer_end}) must be a non-empty range "
                f"inside [0, {cfg.num_hidden_layers})"
            )
        self.cfg = cfg
        self.tp_size, self.tp_rank = tp_size(), tp_rank()  # the checkpoint slices load_weights takes
        self.layer_start = layer_start
        self.layer_end = layer_end
        self.is_first_stage = layer_start == 0
        self.is_last_stage = layer_end == cfg.num_hidden_layers
        self.layer_names = [f"model.layers.{i}.self_attn" for i in range(layer_start, layer_end)]
        self.model = LlamaModel(cfg, layer_start, layer_end, self.decoder_layer_cls)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if self.is_last_stage else None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head with embed_tokens when the stage holds both and the config ties them."""
        if self.cfg.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [n]
        positions: torch.Tensor,  # [n]
        kv_caches: list[torch.Tensor],  # one view per local layer
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,  # [n, hidden]
    ) -> torch.Tensor | IntermediateTensors:
        assert len(kv_caches) == len(self.model.layers), (
            f"{len(kv_caches)} caches for {len(self.model.layers)} layers"
        )
        residual: torch.Tensor | None
        if self.is_first_stage:
            if inputs_embeds is not None:
                hidden = inputs_embeds
            else:
                assert input_ids is not None and self.model.embed_tokens is not None
                hidden = self.model.embed_tokens(input_ids)  # [n, hidden]
            residual = None
        else:
            assert intermediate is not None, "a later pipeline stage needs the previous stage's tensors"
            hidden, residual = intermediate.hidden_states, intermediate.residual

        cos_sin_cache = self.model.rotary_emb.cos_sin_cache(positions.device)  # shared by all layers
        for layer, kv_cache in zip(self.model.layers.values(), kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, cos_sin_cache, kv_cache, meta)
        assert residual is not None

        if not self.is_last_stage:
            return IntermediateTensors(hidden, residual)
        assert self.model.norm is not None
        hidden, _ = self.model.norm(hidden, residual)
        return hidden  # [n, hidden]

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """[n, vocab] logits, fp32 unless ``upcast`` is False (then in the weights' dtype: an
        argmax of those is the argmax of the fp32 ones, without writing and reading them again)."""
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        logits = self.lm_head(hidden)
        return logits.float() if upcast else logits

    # ---- weights -------------------------------------------------------------------------

    def needs_weight(self, name: str) -> bool:
        """Whether this stage keeps the checkpoint tensor ``name`` (the loader reads only those)."""
        if "rotary_emb.inv_freq" in name:
            return False
        if name.startswith("model.layers."):
            return self.layer_start <= int(name.split(".")[2]) < self.layer_end
        if name.startswith("model.embed_tokens."):
            # A tied last stage without the embedding reads its lm_head from here.
            return self.is_first_stage or (self.is_last_stage and self.cfg.tie_word_embeddings)
        if name.startswith("model.norm."):
            return self.is_last_stage
        if name.startswith("lm_head."):
            return self.is_last_stage and not self.cfg.tie_word_embeddings
        return True  # unknown names are reported by load_weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into this stage; skips what it does not hold. Raises ConfigError on
        unknown names, wrong shapes, or parameters left unloaded."""
        self.tie_weights()
        params = self.decoder_parameters()
        loaded: set[tuple[str, str]] = set()  # (parameter name, shard id or "")
        for hf_name, tensor in weights:
            if not self.needs_weight(hf_name):
                continue
            name = hf_name
            if name.startswith("model.embed_tokens.") and self.model.embed_tokens is None:
                name = "lm_head.weight"  # tied last stage
            loaded.add(self._load_one(params, name, tensor))
        expected = {(n, s) for n in params for s in self._shard_ids(n)}
        missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
        if missing:
            raise ConfigError(f"checkpoint lacks {len(missing)} weights this stage needs, e.g. {missing[:3]}")

    def decoder_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters ``load_weights`` fills (tied weights once, under embed_tokens); a
        multimodal subclass leaves out its vision parts, which it loads itself."""
        return dict(self.named_parameters())

    @staticmethod
    def _shard_ids(param_name: str) -> tuple[str, ...]:
        if ".qkv_proj." in param_name:
            return ("q", "k", "v")
        if ".gate_up_proj." in param_name:
            return ("gate", "up")
        return ("",)

    def _load_one(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> tuple[str, str]:
        for piece, (fused_piece, shard) in STACKED_PARAMS.items():
            if piece in name:
                fused_name = name.replace(piece, fused_piece)
                offset, size = self._shard_range(shard)
                dst = self._param(params, fused_name, name).data.narrow(0, offset, size)
                tensor = self._tp_slice(tensor, 0)  # column-parallel: this rank's rows
                self._check_shape(name, dst, tensor)
                dst.copy_(tensor)
                return fused_name, shard
        dst = self._param(params, name, name).data
        if name.endswith((".o_proj.weight", ".down_proj.weight")):
            tensor = self._tp_slice(tensor, 1)  # row-parallel: this rank's input columns
        self._check_shape(name, dst, tensor)
        dst.copy_(tensor)
        return name, ""

    def _tp_slice(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This TP rank's contiguous share of ``tensor`` along ``dim`` (the whole at TP 1)."""
        if self.tp_size == 1:
            return tensor
        assert tensor.shape[dim] % self.tp_size == 0, (tuple(tensor.shape), dim, self.tp_size)
        return tensor.chunk(self.tp_size, dim)[self.tp_rank]

    def _shard_range(self, shard: str) -> tuple[int, int]:
        """(row offset, rows) of a component inside this rank's fused parameter."""
        q_size = self.cfg.num_attention_heads * self.cfg.head_dim // self.tp_size
        kv_size = self.cfg.num_key_value_heads * self.cfg.head_dim // self.tp_size
        inter = self.cfg.intermediate_size // self.tp_size
        return {
            "q": (0, q_size),
            "k": (q_size, kv_size),
            "v": (q_size + kv_size, kv_size),
            "gate": (0, inter),
            "up": (inter, inter),
        }[shard]

    @staticmethod
    def _param(params: dict[str, nn.Parameter], name: str, hf_name: str) -> nn.Parameter:
        if name not in params:
            raise ConfigError(f"checkpoint weight {hf_name!r} has no matching parameter; wrong architecture?")
        return params[name]

    @staticmethod
    def _check_shape(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.shape != src.shape:
            raise ConfigError(
                f"checkpoint weight {name!r} has shape {tuple(src.shape)}, model expects {tuple(dst.shape)}"
            )
