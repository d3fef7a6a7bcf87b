"""The sparse MoE block of Mixtral / Qwen3-MoE decoder layers, and the expert weights' loading.

    mlp.gate           Linear(H, E), the router: logits -> fused_moe.select_experts
    mlp.experts        FusedMoE: gate_up_proj [E, 2I, H], down_proj [E, H, I]

Checkpoints name the experts either per expert (transformers 4 and the released models:
``experts.{e}.w1 / w3 / w2`` for Mixtral under ``block_sparse_moe``, ``experts.{e}.gate_proj /
up_proj / down_proj`` for Qwen3-MoE) or fused as transformers 5 holds them in memory
(``mlp.experts.gate_up_proj`` / ``down_proj``). Both load into the fused layout; every
expert's gate, up and down is checked present.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pdserve.distributed.parallel_state import all_reduce, tp_size
from pdserve.errors import ConfigError
from pdserve.models.config import ModelArchConfig
from pdserve.models.fused_moe import FusedMoE, select_experts
from pdserve.models.linear import Linear
from pdserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM

_PER_EXPERT = re.compile(
    r"(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight"
)
_FUSED = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


class SparseMoeBlock(nn.Module):
    """With TP, every rank routes alike (the router is replicated) and holds I/tp rows of every
    expert's gate and up and the same columns of its down projection (Megatron's MLP split per
    expert); the partial outputs are all-reduced."""

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        tp = tp_size()
        if moe.expert_intermediate_size % tp:
            raise ConfigError(
                f"tensor_parallel_size={tp} does not divide the experts' intermediate size "
                f"{moe.expert_intermediate_size}; use a tensor_parallel_size that divides it"
            )
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = FusedMoE(moe.num_experts, cfg.hidden_size, moe.expert_intermediate_size // tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)  # [n, k] each
        out = self.experts(x, topk_weights, topk_ids)  # [n, H]: this rank's share with TP
        return out if tp_size() == 1 else all_reduce(out)


def use_moe_mlp(layer: LlamaDecoderLayer, cfg: ModelArchConfig, layer_idx: int) -> None:
    """Give a sparse layer (``cfg.moe.sparse_layers``) the MoE block in place of the dense MLP."""
    assert cfg.moe is not None
    if cfg.moe.sparse_layers[layer_idx]:
        layer.mlp = SparseMoeBlock(cfg)  # type: ignore[assignment]


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-shaped decoder whose sparse layers hold an MoE block; subclasses set the layer class."""

    def __init__(self, cfg: ModelArchConfig, layer_start: int = 0, layer_end: int | None = None) -> None:
        if cfg.moe is None:
            raise ConfigError(
                f"{cfg.architecture}: config.json lacks the MoE fields (num_experts_per_tok, ...)"
            )
        super().__init__(cfg, layer_start, layer_end)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._per_expert(weights))

    @staticmethod
    def _per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Mixtral's ``block_sparse_moe`` named ``mlp``; fused expert tensors split per expert."""
        for name, tensor in weights:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            m = _FUSED.fullmatch(name)
            if m is None:
                yield name, tensor
                continue
            layer = m.group(1)
            if tensor.dim() != 3:
                raise ConfigError(f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}; expected 3-D")
            if m.group(2) == "down_proj":
                for e in range(tensor.shape[0]):
                    yield f"{layer}.mlp.experts.{e}.down_proj.weight", tensor[e]
                continue
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{layer}.mlp.experts.{e}.gate_proj.weight", tensor[e, :inter]
                yield f"{layer}.mlp.experts.{e}.up_proj.weight", tensor[e, inter:]

    def _load_one(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> tuple[str, str]:
        m = _PER_EXPERT.fullmatch(name)
        if m is None:
            return super()._load_one(params, name, tensor)
        layer, expert, part = m.group(1), int(m.group(2)), _PART[m.group(3)]
        assert self.cfg.moe is not None
        if expert >= self.cfg.moe.num_experts:
            raise ConfigError(
                f"checkpoint weight {name!r}: expert {expert} but config.json has {self.cfg.moe.num_experts} experts"
            )
        inter = self.cfg.moe.expert_intermediate_size // self.tp_size  # this rank's share
        if part == "down":
            param_name = f"{layer}.mlp.experts.down_proj"
            dst = self._param(params, param_name, name).data[expert]  # [H, I/tp]
            tensor = self._tp_slice(tensor, 1)  # row-parallel: this rank's input columns
        else:
            param_name = f"{layer}.mlp.experts.gate_up_proj"
            tensor = self._tp_slice(tensor, 0)  # column-parallel: this rank's rows
            dst = (
                self._param(params, param_name, name)
                .data[expert]
                .narrow(0, 0 if part == "gate" else inter, inter)
            )
        self._check_shape(name, dst, tensor)
        dst.copy_(tensor)
        return param_name, f"{part}{expert}"

    def _shard_ids(self, param_name: str) -> tuple[str, ...]:  # type: ignore[override]
        assert self.cfg.moe is not None
        experts = range(self.cfg.moe.num_experts)
        if param_name.endswith(".mlp.experts.gate_up_proj"):
            return tuple(f"{part}{e}" for e in experts for part in ("gate", "up"))
        if param_name.endswith(".mlp.experts.down_proj"):
            return tuple(f"down{e}" for e in experts)
        return LlamaForCausalLM._shard_ids(param_name)
