"""CLIP vision tower (the LLaVA image encoder), pure torch, HF parameter names.

    pixel_values [b, 3, S, S] --patch conv--> [b, P, C] (+ class token, + positions)
      -> pre_layrnorm -> encoder layers (pre-norm attention + quick-gelu MLP)

``forward`` returns the hidden state after ``num_layers_used`` encoder layers (LLaVA reads
``vision_feature_layer = -2``: the output of the second-to-last layer, before post_layernorm), so
layers past it are never built and their checkpoint tensors are skipped by ``needs_weight``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.errors import UnsupportedError
from pdserve.models.llama import VocabEmbedding

_ACTS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
}


@dataclass(frozen=True)
class ClipVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ClipVisionConfig:
        if hf.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise UnsupportedError(
                f"vision tower {hf.get('model_type')!r} is not supported; supported: clip_vision_model"
            )
        act = hf.get("hidden_act", "quick_gelu")
        if act not in _ACTS:
            raise UnsupportedError(f"vision hidden_act {act!r} is not supported; supported: {sorted(_ACTS)}")
        return cls(
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=int(hf["num_attention_heads"]),
            image_size=int(hf["image_size"]),
            patch_size=int(hf["patch_size"]),
            num_channels=int(hf.get("num_channels", 3)),
            layer_norm_eps=float(hf.get("layer_norm_eps", 1e-5)),
            hidden_act=act,
        )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class ClipAttention(nn.Module):
    def __init__(self, cfg: ClipVisionConfig) -> None:
        super().__init__()
        c = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = c // self.num_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(c, c), nn.Linear(c, c), nn.Linear(c, c)
        self.out_proj = nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, t, C]
        b, t, c = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [b, H, t, D]

        out = F.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        )
        return self.out_proj(out.transpose(1, 2).reshape(b, t, c))


class ClipMLP(nn.Module):
    def __init__(self, cfg: ClipVisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    def __init__(self, cfg: ClipVisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = ClipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = ClipMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEmbeddings(nn.Module):
    def __init__(self, cfg: ClipVisionConfig) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size, bias=False
        )
        self.position_embedding = VocabEmbedding(cfg.num_patches + 1, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [b, 3, S, S]
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # [b, P, C]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)  # [b, 1, C]
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight  # [b, P + 1, C]


class ClipVisionTower(nn.Module):
    """Parameter names match HF ``CLIPVisionModel.vision_model`` (``embeddings.*``, ``pre_layrnorm``,
    ``encoder.layers.{i}.*``); ``post_layernorm`` is not used by LLaVA and not built."""

    def __init__(self, cfg: ClipVisionConfig, num_layers_used: int) -> None:
        super().__init__()
        assert 0 < num_layers_used <= cfg.num_hidden_layers, (num_layers_used, cfg.num_hidden_layers)
        self.cfg = cfg
        self.embeddings = ClipEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)  # sic: HF's name
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList([ClipEncoderLayer(cfg) for _ in range(num_layers_used)])

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixel_values))  # [b, P + 1, C]
        for layer in self.encoder.layers:  # type: ignore[union-attr]
            x = layer(x)
        return x  # [b, P + 1, C]: the hidden state after the last used layer
