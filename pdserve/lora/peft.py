"""PEFT LoRA folders (``adapter_config.json`` + ``adapter_model.safetensors``) -> ``LoRAAdapter``.

``module_rank_alpha`` and ``module_scale`` are the one place an (adapter, module)'s scale is
computed: ``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``, where ``r`` and ``alpha``
are the module's entries of ``rank_pattern`` / ``alpha_pattern`` (PEFT's matching: the first
pattern ``p`` with ``re.match(rf"(.*\\.)?({p})$", module)``) or the config's ``r`` /
``lora_alpha``. The scale is stored in ``LoRAModuleWeights.scale``; every apply path (the slot
table's dense layers, packed expert weights) reads that field and never derives it again.
Expert LoRA on transformers 5's fused 3-D expert parameters (PEFT's ``target_parameters``) is
split per expert by ``peft_experts.py``, its scale from the parameter's own name
(``model.layers.0.mlp.experts.gate_up_proj``) in the patterns, as PEFT does.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes

from pdserve.lora.ident import adapter_ident
from pdserve.lora.peft_experts import ExpertTarget, expert_pairs, split_experts
from pdserve.lora.weights import LoRAAdapterError, LoRAModuleWeights

__all__ = ["ExpertTarget", "LoRAAdapter", "LoRAAdapterError", "LoRAModuleWeights", "load_peft_adapter"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# Config keys whose non-default value changes what the adapter computes and that the apply
# paths do not implement: refused by name rather than served wrong.
_REFUSED_FLAGS = {
    "use_dora": "DoRA (use_dora: true)",
    "fan_in_fan_out": "fan_in_fan_out: true (Conv1D-style weights)",
    "lora_bias": "lora_bias: true",
    "use_qalora": "QALoRA (use_qalora: true)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
    "modules_to_save": "modules_to_save (full copies of base modules)",
}


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    content_hash: bytes  # blake2b-16 of the config and weights bytes: the adapter's identity
    modules: dict[str, LoRAModuleWeights]  # HF module name (model.layers.0.self_attn.q_proj) -> weights
    max_rank: int

    @property
    def ident(self) -> str:
        """``name@hash`` (hex): what nodes compare to know they hold the same adapter."""
        return adapter_ident(self.name, self.content_hash)

    @property
    def num_bytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def pattern_key(patterns: dict[str, Any], module_name: str) -> str | None:
    """PEFT's ``get_pattern_key``: the first pattern matching the module name's tail, or None."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_name):
            return key
    return None


def module_rank_alpha(config: dict[str, Any], module_name: str) -> tuple[int, float]:
    """(r, alpha) of one module: its ``rank_pattern`` / ``alpha_pattern`` entry or the defaults."""
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    rk, ak = pattern_key(rank_pattern, module_name), pattern_key(alpha_pattern, module_name)
    r = int(rank_pattern[rk]) if rk is not None else int(config.get("r", 8))
    alpha = float(alpha_pattern[ak]) if ak is not None else float(config.get("lora_alpha", 8))
    return r, alpha


def module_scale(r: int, alpha: float, use_rslora: bool) -> float:
    """The LoRA scale: ``alpha / sqrt(r)`` under rsLoRA, else ``alpha / r``."""
    assert r > 0, r
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def content_hash(config_bytes: bytes, weights_bytes: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(len(config_bytes).to_bytes(8, "little"))
    h.update(config_bytes)
    h.update(weights_bytes)
    return h.digest()


def read_config(path: Path) -> tuple[dict[str, Any], bytes]:
    """The folder's adapter config (checked for what pdserve serves) and its bytes."""
    if not path.is_dir():
        raise LoRAAdapterError(f"lora_path {str(path)!r} is not a folder", field="lora_path")
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise LoRAAdapterError(f"lora_path {str(path)!r} has no {CONFIG_FILE}", field="lora_path")
    raw = cfg_file.read_bytes()
    try:
        config = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAAdapterError(f"{cfg_file}: malformed JSON ({e})", field="lora_path") from e
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{cfg_file}: expected a JSON object", field="lora_path")
    check_config(config, str(cfg_file))
    return config, raw


def check_config(config: dict[str, Any], where: str) -> None:
    """LoRAAdapterError naming the first setting pdserve does not serve."""
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise LoRAAdapterError(
            f"{where}: PEFT type {peft_type!r} is not supported; only LORA adapters are served",
            field="lora_path",
        )
    for key, what in _REFUSED_FLAGS.items():
        if config.get(key):
            raise LoRAAdapterError(f"{where}: {what} is not supported", field="lora_path")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(
            f"{where}: bias {config.get('bias')!r} is not supported; only bias: none", field="lora_path"
        )
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, int | float) or value <= 0:
            raise LoRAAdapterError(
                f"{where}: {key} must be a positive number, got {value!r}", field="lora_path"
            )


def load_peft_adapter(
    name: str,
    path: str | Path,
    targets: dict[str, tuple[int, int]],
    max_lora_rank: int,
    expert_targets: dict[str, ExpertTarget] | None = None,
) -> LoRAAdapter:
    """Read and check a PEFT LoRA folder against the model's ``targets`` (HF module name ->
    (in_features, out_features)) and ``expert_targets`` (experts module name -> its 3-D
    parameters). Raises LoRAAdapterError naming the problem; reads nothing into any model."""
    folder = Path(path)
    config, config_bytes = read_config(folder)
    weights_file = folder / WEIGHTS_FILE
    if not weights_file.is_file():
        raise LoRAAdapterError(f"lora_path {str(folder)!r} has no {WEIGHTS_FILE}", field="lora_path")
    weights_bytes = weights_file.read_bytes()
    try:
        tensors = load_safetensors_bytes(weights_bytes)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise LoRAAdapterError(f"{weights_file}: malformed safetensors file ({e})", field="lora_path") from e
    pairs = _pairs(tensors, str(weights_file))
    use_rslora = bool(config.get("use_rslora", False))
    modules: dict[str, LoRAModuleWeights] = {}
    for pair in expert_pairs(pairs, config, expert_targets or {}, str(weights_file)):
        r, alpha = module_rank_alpha(config, pair.key)
        check_rank(r, max_lora_rank, pair.key, str(weights_file))
        modules.update(split_experts(pair, r, module_scale(r, alpha, use_rslora), str(weights_file)))
    for module, (a, b) in sorted(pairs.items()):
        if module not in targets:
            raise LoRAAdapterError(
                f"{weights_file}: target module {module!r} is not a LoRA-capable layer of the model "
                f"(supported: {_target_kinds(targets)})",
                field="lora_path",
            )
        in_features, out_features = targets[module]
        r, alpha = module_rank_alpha(config, module)
        if (
            a.dim() != 2
            or b.dim() != 2
            or tuple(a.shape) != (r, in_features)
            or tuple(b.shape) != (out_features, r)
        ):
            raise LoRAAdapterError(
                f"{weights_file}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; the model "
                f"and the config (r={r}) need ({r}, {in_features}) and ({out_features}, {r}): base-model mismatch?",
                field="lora_path",
            )
        check_rank(r, max_lora_rank, module, str(weights_file))
        modules[module] = LoRAModuleWeights(
            a.float().contiguous(), b.float().contiguous(), r, module_scale(r, alpha, use_rslora)
        )
    if not modules:
        raise LoRAAdapterError(f"{weights_file}: holds no LoRA weights", field="lora_path")
    return LoRAAdapter(
        name=name,
        path=str(folder),
        content_hash=content_hash(config_bytes, weights_bytes),
        modules=modules,
        max_rank=max(m.rank for m in modules.values()),
    )


def check_rank(r: int, max_lora_rank: int, module: str, where: str) -> None:
    if r > max_lora_rank:
        raise LoRAAdapterError(
            f"{where}: {module} has rank {r}, over max_lora_rank {max_lora_rank}; raise "
            f"lora.max_lora_rank or serve a lower-rank adapter",
            field="lora_path",
        )


def _pairs(tensors: dict[str, torch.Tensor], where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module name -> (lora_A, lora_B) from PEFT's key names."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise LoRAAdapterError(
                f"{where}: tensor {key!r} is not a LoRA A/B weight (embedding LoRA, biases and saved "
                "modules are not supported)",
                field="lora_path",
            )
        halves.setdefault(m.group(1), {})[m.group(2)] = t
    out = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(
                f"{where}: {module} lacks lora_{'B' if 'A' in ab else 'A'}", field="lora_path"
            )
        out[module] = (ab["A"], ab["B"])
    return out


def _target_kinds(targets: dict[str, tuple[int, int]]) -> str:
    return ", ".join(sorted({n.rsplit(".", 1)[-1] for n in targets}))
