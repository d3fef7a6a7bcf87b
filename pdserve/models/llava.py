"""LLaVA (``LlavaForConditionalGeneration``): CLIP vision tower + MLP projector + Llama decoder.

    pixel_values [b, 3, S, S] -> vision tower -> hidden state of ``vision_feature_layer``
      -> drop the class token ("default" strategy) -> projector (linear, gelu, linear)
      -> image embeddings [b, num_image_tokens, text_hidden]

The decoder is the Llama stage of ``pdserve.models.llama``; image embeddings replace the
embeddings of the ``<image>`` placeholder tokens (the runner does it, per request item: see
``pdserve.engine.mm_inputs``), so only the first pipeline stage holds the vision parts.

Checkpoint names (both layouts transformers writes or has written):

    language_model.model.* | model.language_model.*   -> model.*   (the decoder)
    language_model.lm_head.* | lm_head.*              -> lm_head.*
    vision_tower.* | model.vision_tower.*             -> vision_tower.* (vision_model. dropped)
    multi_modal_projector.* | model.multi_modal_projector.* -> multi_modal_projector.*
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.errors import ConfigError, UnsupportedError
from pdserve.models.clip_vision import ClipVisionConfig, ClipVisionTower
from pdserve.models.config import ModelArchConfig
from pdserve.models.llama import LlamaForCausalLM

_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


def hf_to_local_name(name: str) -> str:
    for old, new in _RENAMES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    return name.replace("vision_tower.vision_model.", "vision_tower.")


class LlavaProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, bias: bool, act: str) -> None:
        super().__init__()
        if act != "gelu":
            raise UnsupportedError(f"projector_hidden_act {act!r} is not supported; supported: gelu")
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, cfg: ModelArchConfig, layer_start: int = 0, layer_end: int | None = None) -> None:
        super().__init__(cfg, layer_start, layer_end)
        mm = cfg.mm_config
        if mm is None:
            raise ConfigError(
                "a LlavaForConditionalGeneration config.json needs text_config and vision_config"
            )
        self.vision_cfg = ClipVisionConfig.from_hf(mm["vision_config"])
        layer = mm.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise UnsupportedError(f"vision_feature_layer={layer!r} is not supported; use one int layer")
        n = self.vision_cfg.num_hidden_layers
        # hidden_states[k] of HF = the output after k layers (0 = embeddings); negative from the end
        self.num_vision_layers_used = layer if layer >= 0 else n + 1 + layer
        if not 0 < self.num_vision_layers_used <= n:
            raise UnsupportedError(f"vision_feature_layer={layer} selects no encoder layer of {n}")
        self.feature_strategy = mm.get("vision_feature_select_strategy", "default")
        if self.feature_strategy not in ("default", "full"):
            raise UnsupportedError(
                f"vision_feature_select_strategy={self.feature_strategy!r}; supported: default, full"
            )
        token_id = mm.get("image_token_id", mm.get("image_token_index"))
        if token_id is None:
            raise ConfigError("LLaVA config.json has no image_token_index / image_token_id")
        self.image_token_id = int(token_id)
        self.vision_tower: ClipVisionTower | None = None
        self.multi_modal_projector: LlavaProjector | None = None
        if self.is_first_stage:  # image embeddings enter the first pipeline stage only
            self.vision_tower = ClipVisionTower(self.vision_cfg, self.num_vision_layers_used)
            self.multi_modal_projector = LlavaProjector(
                self.vision_cfg.hidden_size,
                cfg.hidden_size,
                bool(mm.get("multimodal_projector_bias", True)),
                str(mm.get("projector_hidden_act", "gelu")),
            )

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens per image (one per patch, + the class token with "full")."""
        return self.vision_cfg.num_patches + (1 if self.feature_strategy == "full" else 0)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[b, 3, S, S] -> [b, num_image_tokens, text_hidden] image embeddings."""
        assert self.vision_tower is not None and self.multi_modal_projector is not None, (
            "only the first pipeline stage holds the vision tower"
        )
        s = self.vision_cfg.image_size
        assert pixel_values.dim() == 4 and tuple(pixel_values.shape[1:]) == (3, s, s), tuple(
            pixel_values.shape
        )
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        feats = self.vision_tower(pixel_values.to(dtype))  # [b, P + 1, Cv]
        if self.feature_strategy == "default":
            feats = feats[:, 1:]  # drop the class token: [b, P, Cv]
        return self.multi_modal_projector(feats)  # [b, T, hidden]

    # ---- weights -------------------------------------------------------------------------

    def decoder_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters() if not n.startswith(_VISION_PREFIXES)}

    def needs_weight(self, name: str) -> bool:
        local = hf_to_local_name(name)
        if local.startswith(_VISION_PREFIXES):
            if not self.is_first_stage or local.startswith("vision_tower.post_layernorm."):
                return False
            if local.startswith("vision_tower.encoder.layers."):
                return int(local.split(".")[3]) < self.num_vision_layers_used
            return True
        return super().needs_weight(local)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vision: dict[str, torch.Tensor] = {}

        def text_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if not self.needs_weight(name):
                    continue
                local = hf_to_local_name(name)
                if local.startswith(_VISION_PREFIXES):
                    vision[local] = tensor
                else:
                    yield local, tensor

        super().load_weights(text_weights())
        params: dict[str, Any] = {n: p for n, p in self.named_parameters() if n.startswith(_VISION_PREFIXES)}
        for name, tensor in vision.items():
            dst = self._param(params, name, name)
            self._check_shape(name, dst, tensor)
            dst.data.copy_(tensor)
        missing = sorted(set(params) - set(vision))
        if missing:
            raise ConfigError(f"checkpoint lacks {len(missing)} vision weights, e.g. {missing[:3]}")


def expand_image_placeholders(
    token_ids: list[int], image_token_id: int, num_image_tokens: int
) -> tuple[list[int], list[int]]:
    """Each single ``<image>`` token of ``token_ids`` becomes a run of ``num_image_tokens`` of them
    (as LlavaProcessor does); returns (expanded ids, offset of each run)."""
    out: list[int] = []
    offsets: list[int] = []
    for t in token_ids:
        if t == image_token_id:
            offsets.append(len(out))
            out.extend([image_token_id] * num_image_tokens)
        else:
            out.append(t)
    return out, offsets
