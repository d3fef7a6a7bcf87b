"""Expert LoRA of PEFT's ``target_parameters`` (PEFT 0.21's ``lora.ParamWrapper``) -> per-expert
``LoRAModuleWeights``.

transformers 5 holds a MoE layer's experts as 3-D parameters of one module (``mlp.experts.
gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]); PEFT adapts them with
``target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``. Per parameter it
saves one pair for all experts, rank r each (PEFT's ``ParamWrapper.get_delta_weight``):

    lora_A  [r*E, in]    expert e's A = rows [e*r, (e+1)*r)          (reshape (E, r, in))
    lora_B  [out, r*E]   expert e's B = columns e, E+e, 2E+e, ...    (reshape (out, r, E))
    delta W[e] = scale * B_e @ A_e     [out, in], scale from the parameter's own r / alpha

Several parameters of one module nest: PEFT wraps the module once per targeted parameter in
registration order, each wrapper around the previous one, so the file names the last one
``experts.lora_A``, the one before ``experts.base_layer.lora_A``, and so on. ``expert_pairs``
undoes that naming with the config's ``target_parameters`` (PEFT's matching: the name equals the
target or ends with ``.target``) and the module's parameter order; shapes are checked after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pdserve.lora.weights import LoRAAdapterError, LoRAModuleWeights

_BASE = ".base_layer"


@dataclass(frozen=True)
class ExpertTarget:
    """A fused experts module whose 3-D parameters PEFT's ``target_parameters`` adapts."""

    num_experts: int
    params: tuple[tuple[str, int, int], ...]  # (name, in_features, out_features), in registration order


@dataclass(frozen=True)
class ExpertPair:
    experts: str  # the module, e.g. model.layers.0.mlp.experts
    param: str  # gate_up_proj | down_proj
    a: torch.Tensor
    b: torch.Tensor
    target: ExpertTarget

    @property
    def key(self) -> str:
        """What PEFT matches rank_pattern / alpha_pattern against."""
        return f"{self.experts}.{self.param}"


def _targeted(wanted: list[str], key: str) -> bool:
    return any(key == t or key.endswith(f".{t}") for t in wanted)


def expert_pairs(
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
    config: dict[str, Any],
    expert_targets: dict[str, ExpertTarget],
    where: str,
) -> list[ExpertPair]:
    """Remove from ``pairs`` (module name -> (lora_A, lora_B)) those of expert parameters."""
    wanted = [str(t) for t in config.get("target_parameters") or []]
    out = []
    for module in sorted(pairs):
        experts, depth = module, 0
        while experts.endswith(_BASE):
            experts, depth = experts[: -len(_BASE)], depth + 1
        target = expert_targets.get(experts)
        if target is None:
            continue
        targeted = [p for p, _, _ in target.params if _targeted(wanted, f"{experts}.{p}")]
        if depth >= len(targeted):
            raise LoRAAdapterError(
                f"{where}: {module} matches no parameter of {experts} that target_parameters {wanted} "
                f"select (its parameters: {[p for p, _, _ in target.params]})",
                field="lora_path",
            )
        a, b = pairs.pop(module)
        out.append(ExpertPair(experts, targeted[len(targeted) - 1 - depth], a, b, target))
    return out


def split_experts(pair: ExpertPair, r: int, scale: float, where: str) -> dict[str, LoRAModuleWeights]:
    """``{experts}.{e}.{param}`` -> expert e's LoRA (a [r, in], b [out, r], the stored scale)."""
    e = pair.target.num_experts
    _, fin, fout = next(t for t in pair.target.params if t[0] == pair.param)
    if tuple(pair.a.shape) != (r * e, fin) or tuple(pair.b.shape) != (fout, r * e):
        raise LoRAAdapterError(
            f"{where}: {pair.key} has lora_A {tuple(pair.a.shape)} and lora_B {tuple(pair.b.shape)}; the model "
            f"({e} experts) and the config (r={r}) need ({r * e}, {fin}) and ({fout}, {r * e}): base-model mismatch?",
            field="lora_path",
        )
    a = pair.a.float().reshape(e, r, fin)
    b = pair.b.float().reshape(fout, r, e).permute(2, 0, 1)  # [E, out, r]
    return {
        f"{pair.experts}.{x}.{pair.param}": LoRAModuleWeights(a[x].contiguous(), b[x].contiguous(), r, scale)
        for x in range(e)
    }
