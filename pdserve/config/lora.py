"""LoRA settings (frozen) and the checks a setting gets at start."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.errors import ConfigError

APPLY_MODES = ("auto", "segmented", "dense", "bgmv")


@dataclass(frozen=True)
class LoRAConfig:
    """``max_loras`` adapters resident at once (the slot table); every adapter's rank at most
    ``max_lora_rank``; ``modules`` (name, PEFT folder) pairs loaded at start. Adapters past
    ``max_loras`` stay in host memory and are swapped into a slot (LRU) when a step needs them;
    ``max_cpu_loras`` bounds how many are registered at all (None: no bound)."""

    max_loras: int = 4
    max_lora_rank: int = 16
    modules: tuple[tuple[str, str], ...] = ()
    max_cpu_loras: int | None = None
    # How a step applies its adapters (pdserve/lora/apply.py): segmented (rows grouped by
    # adapter, two small GEMMs per adapter), dense (two GEMMs over every slot's stacked A / B
    # with a per-row mask) or bgmv (the Triton kernels, CUDA); auto: bgmv on CUDA when triton
    # imports, else segmented or dense by the measured crossover.
    apply_mode: str = "auto"

    def __post_init__(self) -> None:
        if not 1 <= self.max_loras <= 256:
            raise ConfigError(f"lora.max_loras must be in [1, 256], got {self.max_loras!r}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ConfigError(f"lora.max_lora_rank must be in [1, 512], got {self.max_lora_rank!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"lora.max_cpu_loras ({self.max_cpu_loras}) must be >= lora.max_loras ({self.max_loras}) or unset"
            )
        if self.apply_mode not in APPLY_MODES:
            raise ConfigError(f"lora.apply_mode must be one of {APPLY_MODES}, got {self.apply_mode!r}")
        names = [n for n, _ in self.modules]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"lora.modules names must be unique; repeated: {dup}")
        for n in names:
            check_lora_name(n)


def check_lora_name(name: str) -> None:
    """ConfigError unless ``name`` is a usable adapter name (it is the OpenAI ``model`` value)."""
    if not name or len(name) > 256 or any(c.isspace() for c in name):
        raise ConfigError(f"a LoRA adapter name must be 1-256 characters without spaces, got {name!r}")


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's shape for the offline API: the adapter a prompt runs under. With ``lora_path`` the
    adapter is loaded on first use (the same name with other content is refused)."""

    lora_name: str
    lora_int_id: int = 0  # accepted for vLLM compatibility; the name identifies the adapter
    lora_path: str | None = None
