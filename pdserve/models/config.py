"""Architecture config parsed from a Hugging Face ``config.json`` (+ ``generation_config.json``).

Only what the decoder models read is kept; anything the models cannot honour (sliding windows,
unknown RoPE scaling, partial rotary) raises ``UnsupportedError`` here, at load time.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.errors import ConfigError, UnsupportedError
from pdserve.models.moe_config import MoEArchConfig, moe_fields

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str  # one of SUPPORTED_ROPE_TYPES
    theta: float
    factor: float = 1.0  # linear, llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> RopeConfig:
        """Reads v5 ``rope_parameters`` or v4 ``rope_theta`` + ``rope_scaling``."""
        params = dict(hf.get("rope_parameters") or {})
        if params and all(isinstance(v, dict) for v in params.values()):
            raise UnsupportedError(f"per-layer-type rope_parameters {sorted(params)} are not supported")
        params.update(hf.get("rope_scaling") or {})  # v4: scaling keys live apart from rope_theta
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedError(
                f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise UnsupportedError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
        if rope_type == "default":
            return cls(rope_type, float(theta))
        if rope_type == "linear":
            return cls(rope_type, float(theta), factor=float(params["factor"]))
        return cls(
            rope_type,
            float(theta),
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", hf["max_position_embeddings"])
            ),
        )

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """Inverse frequencies [head_dim // 2] in fp32, the same formulas as transformers."""
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (self.theta**exponent)  # [head_dim // 2]
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            old_ctx = self.original_max_position_embeddings
            low_freq_wavelen = old_ctx / self.low_freq_factor
            high_freq_wavelen = old_ctx / self.high_freq_factor
            wavelen = 2 * torch.pi / inv_freq
            # wavelen < high: keep; wavelen > low: divide by factor; between: interpolate.
            scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (old_ctx / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
            return torch.where(is_medium, smoothed, scaled)
        return inv_freq


@dataclass(frozen=True)
class ModelArchConfig:
    architectures: tuple[str, ...]  # HF class names, e.g. ("Qwen3ForCausalLM",)
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Llama/Qwen3: bias on q/k/v/o; Qwen2 always has q/k/v bias (see qwen2.py)
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]  # generation_config.json first, then config.json
    bos_token_id: int | None
    torch_dtype: str | None  # checkpoint dtype as written ("bfloat16"), None if absent
    # Multimodal checkpoints (LLaVA): the top-level config.json without its text_config (the
    # decoder fields above come from text_config). None for text-only models.
    mm_config: dict[str, Any] | None = None
    # Hybrid attention (Gemma-3 text): each layer's type ("full_attention" | "sliding_attention"),
    # the window of the sliding ones, their RoPE, and Gemma's query scale and logit soft cap.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local: RopeConfig | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # Mixture-of-experts families (Mixtral, Qwen3-MoE; models/moe_config.py); None for dense models.
    moe: MoEArchConfig | None = None
    # LFM2: the depthwise causal convolutions' kernel size and bias ("conv" in layer_types)
    conv_kernel_size: int | None = None
    conv_bias: bool = False

    @property
    def architecture(self) -> str:
        return self.architectures[0]

    @classmethod
    def from_hf(cls, hf: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelArchConfig:
        def need(key: str) -> Any:
            if key not in hf or hf[key] is None:
                raise ConfigError(f"config.json has no {key!r}; is this a decoder-only LLM checkpoint?")
            return hf[key]

        layer_types = hf.get("layer_types") or []
        hybrid = hybrid_fields(hf) if hf.get("model_type") == "gemma3_text" else {}
        if hf.get("model_type") == "lfm2":
            hf, hybrid = lfm2_fields(hf)
        if not hybrid and (hf.get("use_sliding_window") or "sliding_attention" in layer_types):
            raise UnsupportedError(
                "sliding-window attention is supported for Gemma-3 text models only; set use_sliding_window=false"
            )
        num_heads = int(need("num_attention_heads"))
        generation = generation or {}
        eos: list[int] = []
        for source in (generation.get("eos_token_id"), hf.get("eos_token_id")):
            ids = source if isinstance(source, list) else [] if source is None else [source]
            eos.extend(int(i) for i in ids if int(i) not in eos)
        bos = generation.get("bos_token_id", hf.get("bos_token_id"))
        archs = hf.get("architectures") or []
        if not archs:
            raise ConfigError("config.json has no 'architectures' list; cannot pick a model class")
        return cls(
            architectures=tuple(archs),
            model_type=str(hf.get("model_type", "")),
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or need("hidden_size") // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=hybrid.pop("rope", None) or RopeConfig.from_hf(hf),
            max_position_embeddings=int(need("max_position_embeddings")),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias") or False),
            mlp_bias=bool(hf.get("mlp_bias") or False),
            eos_token_ids=tuple(eos),
            bos_token_id=None if bos is None else int(bos),
            torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
            moe=moe_fields(hf),
            **hybrid,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelArchConfig:
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"{config_path} not found; pass a Hugging Face checkpoint folder")
        hf = json.loads(config_path.read_text())
        mm: dict[str, Any] | None = None
        if isinstance(hf.get("text_config"), dict):  # LLaVA-style: decoder fields live in text_config
            mm = {k: v for k, v in hf.items() if k != "text_config"}
            hf = {**hf["text_config"], "architectures": hf.get("architectures")}
            hf.setdefault("dtype", mm.get("dtype") or mm.get("torch_dtype"))
        gen_path = model_dir / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
        cfg = cls.from_hf(hf, generation)
        return cfg if mm is None else dataclasses.replace(cfg, mm_config=mm)


def hybrid_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """A Gemma-3 text config's per-layer attention types, window, the two RoPEs (v5
    ``rope_parameters`` per layer type, or v4 ``rope_theta`` + ``rope_local_base_freq``)."""
    if hf.get("attn_logit_softcapping") is not None:
        raise UnsupportedError("attn_logit_softcapping is not supported (Gemma-3 sets none)")
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedError("use_bidirectional_attention is not supported")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise UnsupportedError(f"hidden_activation {hf.get('hidden_activation')!r} is not supported")
    n = int(hf["num_hidden_layers"])
    layer_types = tuple(hf.get("layer_types") or ())
    if len(layer_types) != n or not set(layer_types) <= {"full_attention", "sliding_attention"}:
        raise ConfigError(
            f"layer_types {list(layer_types)} must name full_attention or sliding_attention for {n} layers"
        )
    params = hf.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        rope = RopeConfig.from_hf({**hf, "rope_parameters": params["full_attention"]})
        local = RopeConfig.from_hf({**hf, "rope_parameters": params["sliding_attention"]})
    else:
        rope = RopeConfig.from_hf(hf)
        local = RopeConfig("default", float(hf.get("rope_local_base_freq", 10000.0)))
    softcap = hf.get("final_logit_softcapping")
    return {
        "layer_types": layer_types,
        "sliding_window": int(hf["sliding_window"]),
        "rope": rope,
        "rope_local": local,
        "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar") or hf["head_dim"]),
        "final_logit_softcapping": None if softcap is None else float(softcap),
    }


def lfm2_fields(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An LFM2 config read as the common fields name them (its norm epsilon, its feed-forward
    width after transformers' adjustment), and its layer types and convolution settings."""
    n = int(hf["num_hidden_layers"])
    layer_types = tuple(hf.get("layer_types") or ())
    if not layer_types:
        full = hf.get("full_attn_idxs")
        full = range(n) if full is None else full
        layer_types = tuple("full_attention" if i in full else "conv" for i in range(n))
    if len(layer_types) != n or not set(layer_types) <= {"full_attention", "conv"}:
        raise ConfigError(f"layer_types {list(layer_types)} must name full_attention or conv for {n} layers")
    inter = int(hf.get("block_ff_dim", hf["intermediate_size"]))
    if hf.get("block_auto_adjust_ff_dim", True):  # as transformers' Lfm2MLP
        inter = int(2 * inter / 3)
        mult = hf.get("block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            multiple = int(hf.get("block_multiple_of", 256))
            inter = multiple * ((int(mult * inter) + multiple - 1) // multiple)
    tie = hf.get("tie_embedding", hf.get("tie_word_embeddings", True))
    common = {**hf, "rms_norm_eps": hf.get("norm_eps", 1e-5), "intermediate_size": inter}
    common["tie_word_embeddings"] = tie
    return common, {
        "layer_types": layer_types,
        "conv_kernel_size": int(hf.get("conv_L_cache", 3)),
        "conv_bias": bool(hf.get("conv_bias", False)),
    }


# generation_config.json keys a request inherits when it leaves them unset (vLLM's
# ``--generation-config auto``); their names are the same in SamplingParams.
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


def generation_defaults(model_dir: str | Path) -> dict[str, float]:
    """The sampling defaults ``generation_config.json`` sets (empty without the file)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        gen = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    out: dict[str, float] = {}
    for key in GENERATION_DEFAULT_KEYS:
        value = gen.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = value
    return out


@dataclass
class IntermediateTensors:
    """What one pipeline stage hands the next: the residual stream before the next layer's norm."""

    hidden_states: torch.Tensor  # [num_tokens, hidden_size]
    residual: torch.Tensor  # [num_tokens, hidden_size]
