"""HF ``architectures`` name -> our model class."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.errors import UnsupportedError
from pdserve.models.gemma3 import Gemma3ForCausalLM
from pdserve.models.lfm2 import Lfm2ForCausalLM
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.llava import LlavaForConditionalGeneration
from pdserve.models.mixtral import MixtralForCausalLM
from pdserve.models.qwen2 import Qwen2ForCausalLM
from pdserve.models.qwen3 import Qwen3ForCausalLM
from pdserve.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
}


def get_model_class(hf_architectures: Sequence[str] | str) -> type[LlamaForCausalLM]:
    """The class for the first supported name in config.json's ``architectures``."""
    names = [hf_architectures] if isinstance(hf_architectures, str) else list(hf_architectures)
    for name in names:
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    raise UnsupportedError(
        f"model architecture {names} is not supported; supported: {', '.join(sorted(MODEL_CLASSES))}"
    )
