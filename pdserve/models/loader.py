"""Load one pipeline stage of a HF checkpoint folder (config.json + *.safetensors), and its tokenizer.

Weights are read with ``safetensors.safe_open`` only (never pickle), and only the tensors the
stage keeps; with a sharded checkpoint, shards holding none of them are not even opened.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.errors import ConfigError
from pdserve.models.config import ModelArchConfig
from pdserve.models.linear import prepare_small_gemms
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.registry import get_model_class

SAFETENSORS_INDEX = "model.safetensors.index.json"


def iter_safetensors(
    model_dir: str | Path, wanted: Callable[[str], bool]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for each checkpoint tensor with ``wanted(name)``, one at a time."""
    model_dir = Path(model_dir)
    index_path = model_dir / SAFETENSORS_INDEX
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        files = sorted({f for name, f in weight_map.items() if wanted(name)})
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors weights in {model_dir}; only safetensors checkpoints load")
    for file in files:
        with safe_open(str(model_dir / file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if wanted(name):
                    yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    layer_start: int = 0,
    layer_end: int | None = None,
) -> tuple[LlamaForCausalLM, ModelArchConfig]:
    """Build the stage for layers [layer_start, layer_end) on ``device`` in ``dtype``, in eval mode."""
    cfg = ModelArchConfig.from_model_dir(model_dir)
    model_cls = get_model_class(cfg.architectures)
    with torch.device("meta"):  # no allocation or random init for weights about to be overwritten
        model = model_cls(cfg, layer_start, layer_end)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.load_weights(iter_safetensors(model_dir, model.needs_weight))
    model.eval().requires_grad_(False)
    prepare_small_gemms(model)  # CPU half precision: tiny layers' small calls in fp32 (models/linear.py)
    return model, cfg


def load_tokenizer(model_dir: str | Path):  # -> transformers.PreTrainedTokenizerBase
    """The checkpoint's tokenizer, from the folder only (never the hub)."""
    from transformers import AutoTokenizer  # slow import, kept off the engine's import path

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
