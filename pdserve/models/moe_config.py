"""The mixture-of-experts fields of a Mixtral- or Qwen3-MoE-shaped ``config.json``.

    family      experts              expert MLP rows          router weights          dense layers
    ---------   ------------------   ----------------------   ---------------------   ------------------
    mixtral     num_local_experts    intermediate_size        softmax, top-k, sum 1   none
    qwen3_moe   num_experts          moe_intermediate_size    softmax, top-k, sum 1   mlp_only_layers and
                                                              only if norm_topk_prob  (i+1) % decoder_sparse_step
                                                                                      != 0 (intermediate_size)

Mixtral's softmax over the top-k logits equals the softmax over all experts renormalised over
the top k, which is how transformers computes both families.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.errors import ConfigError, UnsupportedError

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")


@dataclass(frozen=True)
class MoEArchConfig:
    num_experts: int
    top_k: int  # experts per token (num_experts_per_tok)
    expert_intermediate_size: int  # rows of one expert's gate (and of its up) projection
    renormalize: bool  # the top-k weights divided by their sum
    sparse_layers: tuple[bool, ...]  # per decoder layer: an MoE block (True) or the dense MLP


def moe_fields(hf: dict[str, Any]) -> MoEArchConfig | None:
    """The MoE config of a Mixtral / Qwen3-MoE ``config.json`` (None for other model types);
    raises for settings these families' forward does not implement."""
    model_type = hf.get("model_type")
    if model_type not in MOE_MODEL_TYPES:
        return None
    n = int(hf["num_hidden_layers"])
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedError(
            f"{model_type}: hidden_act {hf.get('hidden_act')!r} is not supported (silu only)"
        )
    if model_type == "mixtral":
        if hf.get("sliding_window") is not None:
            raise UnsupportedError(
                f"mixtral: sliding_window={hf['sliding_window']} is not supported; set sliding_window to null "
                "(attention over the whole sequence)"
            )
        num_experts, inter = int(hf["num_local_experts"]), int(hf["intermediate_size"])
        renormalize, sparse = True, (True,) * n
    else:
        # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute map)
        num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
        inter = int(hf["moe_intermediate_size"])
        renormalize = bool(hf.get("norm_topk_prob", False))
        step = int(hf.get("decoder_sparse_step", 1))
        dense = set(hf.get("mlp_only_layers") or [])
        sparse = tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(n))
    top_k = int(hf["num_experts_per_tok"])
    if any(sparse) and not 1 <= top_k <= num_experts:
        raise ConfigError(
            f"{model_type}: num_experts_per_tok={top_k} must be in [1, {num_experts}] (the experts)"
        )
    return MoEArchConfig(num_experts, top_k, inter, renormalize, sparse)
