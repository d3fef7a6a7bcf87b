"""The offline API's LoRA arguments (vLLM's shapes) -> adapter names per prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

from pdserve.config.lora import LoRAConfig, LoRARequest
from pdserve.errors import ConfigError, InvalidRequestError

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine

LoRARequestLike = Union[LoRARequest, str, None]  # noqa: UP007  (a runtime alias)


def lora_config_from_dict(d: Mapping[str, Any]) -> LoRAConfig:
    """``{"max_loras", "max_lora_rank", "max_cpu_loras", "apply_mode", "modules": {name: path}}``."""
    allowed = {"max_loras", "max_lora_rank", "max_cpu_loras", "apply_mode", "modules"}
    extra = sorted(set(d) - allowed)
    if extra:
        raise ConfigError(f"lora: unknown settings {extra}; supported: {sorted(allowed)}")
    kw = dict(d)
    modules = kw.pop("modules", None) or {}
    if not isinstance(modules, Mapping):
        raise ConfigError(
            f"lora.modules must be a mapping of name -> PEFT folder, got {type(modules).__name__}"
        )
    return LoRAConfig(modules=tuple((str(k), str(v)) for k, v in modules.items()), **kw)


def lora_names(
    engine: LLMEngine, lora_request: LoRARequestLike | Sequence[LoRARequestLike], num_prompts: int
) -> list[str] | None:
    """One adapter name per prompt ("" = base model), loading any LoRARequest given with a path."""
    if lora_request is None:
        return None
    if isinstance(lora_request, str | LoRARequest):
        items: list[LoRARequestLike] = [lora_request] * num_prompts
    else:
        items = list(lora_request)
        if len(items) != num_prompts:
            raise InvalidRequestError(
                f"lora_request: {num_prompts} prompts but {len(items)} LoRA requests", field="lora_request"
            )
    names = []
    for item in items:
        if isinstance(item, LoRARequest):
            if item.lora_path is not None:
                if engine.lora is None:
                    raise InvalidRequestError(
                        "lora_request: this engine serves no LoRA adapters (pass lora=... to LLM)",
                        field="lora_request",
                    )
                engine.lora.load(item.lora_name, item.lora_path)
            names.append(item.lora_name)
        else:
            names.append(item or "")
    return names
