"""LoRAManager: the adapters a model runner serves, and the slot table of resident ones.

    registered (host memory, LoRAAdapter) --activate--> resident in a slot (LoRASlots of every layer)
                                          <--evict (LRU, only slots no step of now needs)--

MoE layers (``models.fused_moe.FusedMoE``) get ``lora.moe.ExpertLoRASlots``: each adapter's
expert LoRA packed into the fused expert layout, a slot's stacks beside the dense layers' ones.

At most ``max_loras`` adapters are resident; the scheduler admits requests of at most that many
distinct adapters at once (``Scheduler.max_loras``), so a step's adapters always fit.
"""

from __future__ import annotations

import importlib.util
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pdserve.config.lora import LoRAConfig, check_lora_name
from pdserve.errors import ConfigError, InvalidRequestError
from pdserve.lora.apply import LoRASlots, LoRAStep
from pdserve.lora.moe import attach_expert_slots
from pdserve.lora.peft import ExpertTarget, LoRAAdapter, LoRAAdapterError, load_peft_adapter

# Our fused layer -> the HF modules it holds, in output order.
FUSED_SHARDS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "o_proj": ("o_proj",),
    "down_proj": ("down_proj",),
}
# From this many distinct adapters in a step the dense apply is used. bench/lora.py
# --apply-modes segmented dense (CPU, batch 16, rank 16, 16 slots, a host at load 8 on 2 cores):
# segmented 840 / 497 / 315 tok/s with 1 / 4 / 16 adapters, dense 372 / 410 / 398 (its cost
# follows max_loras, not the adapters present); the crossover lies between 4 and 16.
DENSE_MIN_ADAPTERS = 8


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@dataclass
class LoRAMetrics:
    slot_loads: int = 0  # adapters written into a slot
    slot_evictions: int = 0  # resident adapters evicted to host memory for another


class LoRAManager:
    def __init__(
        self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.config = config
        self.metrics = LoRAMetrics()
        runs_triton = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
        if config.apply_mode == "bgmv" and not (runs_triton and _triton_available()):
            raise ConfigError(
                f"lora.apply_mode bgmv runs the Triton kernels: it needs triton and a CUDA device (device "
                f"{device}); use auto, segmented or dense"
            )
        self.targets: dict[str, tuple[int, int]] = {}  # HF module name -> (in, out)
        self.layers: list[tuple[str, LoRASlots]] = []  # (our layer name, slots)
        compute_dtype = torch.float32 if device.type == "cpu" else dtype
        for name, module in model.named_modules():
            kind = name.rsplit(".", 1)[-1]
            if kind not in FUSED_SHARDS or not isinstance(module, nn.Linear):
                continue
            prefix = name[: -len(kind)]
            shards, offset = [], 0
            sizes = self._shard_sizes(model, prefix, module, kind)
            for hf, size in zip(FUSED_SHARDS[kind], sizes, strict=True):
                shards.append((hf, offset, size))
                self.targets[prefix + hf] = (module.in_features, size)
                offset += size
            slots = LoRASlots(
                module.in_features, shards, config.max_loras, config.max_lora_rank, compute_dtype, device
            )
            module.lora = slots  # type: ignore[assignment]  # read by models.linear.Linear.forward
            self.layers.append((prefix, slots))
        self.expert_targets: dict[str, ExpertTarget] = {}  # fused experts module -> its 3-D parameters
        self.expert_layers = attach_expert_slots(
            model, config, compute_dtype, device, self.targets, self.expert_targets
        )
        if not self.layers:
            raise ConfigError(f"lora: the model {type(model).__name__} has no LoRA-capable layers")
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # resident adapters, least recent first
        self.free_slots = list(range(config.max_loras))

    @staticmethod
    def _shard_sizes(model: nn.Module, prefix: str, module: nn.Linear, kind: str) -> list[int]:
        """Output rows of each HF module inside our (possibly fused) layer."""
        if kind == "qkv_proj":
            attn = model.get_submodule(prefix.rstrip("."))
            q_size, kv_size = int(getattr(attn, "q_size")), int(getattr(attn, "kv_size"))  # noqa: B009
            return [q_size, kv_size, kv_size]
        if kind == "gate_up_proj":
            return [module.out_features // 2] * 2
        return [module.out_features]

    # -- registry ----------------------------------------------------------------------------
    def add_adapter(self, name: str, path: str | Path) -> LoRAAdapter:
        """Load and check a PEFT folder under ``name``; nothing changes on an error. Loading the
        same name again with the same content is a no-op; other content is refused."""
        try:
            check_lora_name(name)
        except ConfigError as e:
            raise LoRAAdapterError(str(e), field="lora_name") from e
        adapter = load_peft_adapter(name, path, self.targets, self.config.max_lora_rank, self.expert_targets)
        old = self.adapters.get(name)
        if old is not None:
            if old.content_hash == adapter.content_hash:
                return old
            raise LoRAAdapterError(
                f"lora_name {name!r} is already loaded with other weights ({old.path}); unload it first",
                field="lora_name",
            )
        limit = self.config.max_cpu_loras
        if limit is not None and len(self.adapters) >= limit:
            raise LoRAAdapterError(
                f"{len(self.adapters)} adapters are loaded, lora.max_cpu_loras is {limit}; unload one first",
                field="lora_name",
            )
        self.adapters[name] = adapter
        return adapter

    def remove_adapter(self, name: str) -> None:
        """Forget ``name`` (its slot freed). The engine calls it once no request uses it."""
        if name not in self.adapters:
            raise InvalidRequestError(f"lora_name {name!r} is not loaded", field="lora_name")
        del self.adapters[name]
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            for _, layer in self.layers:
                layer.clear_slot(slot)
            for experts in self.expert_layers:
                experts.clear_slot(slot)
            self.free_slots.append(slot)

    def get(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise InvalidRequestError(
                f"model {name!r}: no such LoRA adapter is loaded (loaded: {sorted(self.adapters)})",
                field="model",
            )
        return adapter

    # -- slot table --------------------------------------------------------------------------
    def activate(self, names: Sequence[str]) -> dict[str, int]:
        """Make every adapter in ``names`` resident; slot per name. Evicts least recently used
        residents not in ``names``."""
        wanted = list(dict.fromkeys(n for n in names if n))
        assert len(wanted) <= self.config.max_loras, (wanted, self.config.max_loras)
        for name in wanted:
            if name in self.slot_of:
                self.slot_of.move_to_end(name)
                continue
            if not self.free_slots:
                victim = next(n for n in self.slot_of if n not in wanted)
                self.free_slots.append(self.slot_of.pop(victim))
                self.metrics.slot_evictions += 1
            slot = self.free_slots.pop()
            self._write_slot(slot, self.adapters[name])
            self.slot_of[name] = slot
            self.metrics.slot_loads += 1
        return {n: self.slot_of[n] for n in wanted}

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for prefix, layer in self.layers:
            layer.set_slot(slot, [adapter.modules.get(prefix + hf) for hf, _, _ in layer.shards])
        for experts in self.expert_layers:
            experts.set_slot(slot, adapter.modules)

    def begin_step(self, chunk_loras: Sequence[tuple[str, int]], device: torch.device) -> None:
        """Set every layer's per-row slots for a step of (adapter name or "", num_tokens) chunks."""
        if not any(name for name, _ in chunk_loras):
            self._set_step(None)
            return
        slots = self.activate([name for name, _ in chunk_loras])
        per_chunk = [(slots[name] if name else -1, n) for name, n in chunk_loras]
        mode = self.config.apply_mode
        if mode == "auto" and device.type == "cuda" and _triton_available():
            mode = "bgmv"
        elif mode == "auto":
            mode = "dense" if len(slots) >= DENSE_MIN_ADAPTERS else "segmented"
        compute_dtype = self.layers[0][1].a.dtype
        self._set_step(LoRAStep.build(per_chunk, self.config.max_loras, mode, compute_dtype, device))

    def _set_step(self, step: LoRAStep | None) -> None:
        for _, layer in self.layers:
            layer.step = step
        for experts in self.expert_layers:
            experts.step = step
