"""The cluster file's ``lora:`` section (every node of the file serves these adapters)."""

from __future__ import annotations

from pydantic import Field

from pdserve.config.frozen import _Frozen
from pdserve.config.lora import LoRAConfig


class LoRASettings(_Frozen):
    """vLLM's names: ``max_loras`` resident adapters (slots), ``max_lora_rank``, ``modules``
    {name: PEFT folder} loaded at start on every node; ``max_cpu_loras`` bounds how many are
    loaded at all (None: no bound). Requests select an adapter by the OpenAI ``model`` field."""

    max_loras: int = Field(default=4, ge=1, le=256)
    max_lora_rank: int = Field(default=16, ge=1, le=512)
    max_cpu_loras: int | None = Field(default=None, ge=1)
    modules: dict[str, str] = Field(default_factory=dict)

    def to_config(self) -> LoRAConfig:
        return LoRAConfig(
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
            modules=tuple(self.modules.items()),
        )
