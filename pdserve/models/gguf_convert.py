"""A ``.gguf`` checkpoint -> a Hugging Face folder (float32 safetensors, tokenizer with its chat
template, config.json, generation_config.json) that models/loader.py reads like any other.

transformers dequantizes the tensors (``from_pretrained(dir, gguf_file=...)``, read with the
``gguf`` package's memory-mapped reader: nothing is unpickled) and undoes llama.cpp's Q/K row
permutation. A GGUF-loaded model refuses ``save_pretrained``, so its weights move into a fresh
model of the same class built without ``quantization_config``.

Concurrent starts on one host (several nodes of ``pdserve up``) do not race: each builds in a
private temporary folder next to the target and renames it into place; the first rename wins and
the others drop their copy. The rename is atomic, so a folder at the target is always complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from pdserve.errors import ConfigError

logger = logging.getLogger(__name__)

# general.architecture -> the HF class pdserve serves it with (models/registry.py)
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
MARKER = "pdserve-gguf.json"  # written last inside the folder: what it was converted from
CONVERTER_VERSION = 1


def read_gguf_architecture(path: Path) -> str:
    """``general.architecture`` of the file; ConfigError naming the file if it is no readable GGUF."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except KeyError as e:
        raise ConfigError(f"GGUF file {path} has no general.architecture field; is it a model?") from e
    except (ValueError, OSError, IndexError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from e


def check_supported(path: Path, arch: str) -> None:
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(
            f"GGUF file {path} holds a {arch!r} model; supported GGUF architectures: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """``out_dir`` holding the converted checkpoint, built now unless it already exists."""
    if (out_dir / MARKER).is_file():
        return out_dir
    arch = read_gguf_architecture(gguf_path)
    check_supported(gguf_path, arch)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        t0 = time.monotonic()
        logger.info("converting GGUF %s (%s) into %s ...", gguf_path, arch, out_dir)
        # Load from a folder holding only a link to the file, so nothing else next to the user's
        # file (a stray config.json or pytorch_model.bin) is ever read.
        src = tmp / "src"
        src.mkdir()
        (src / gguf_path.name).symlink_to(gguf_path.resolve())
        built = tmp / "model"
        _dequantize(src, gguf_path.name, built)
        meta = {"source": str(gguf_path.resolve()), "architecture": arch, "converter": CONVERTER_VERSION}
        (built / MARKER).write_text(json.dumps(meta, indent=1) + "\n")
        try:
            os.rename(built, out_dir)
        except OSError:
            if not (out_dir / MARKER).is_file():  # not a concurrent winner's folder: a real error
                raise
        logger.info("converted %s in %.1f s", gguf_path.name, time.monotonic() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _dequantize(src: Path, name: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src), gguf_file=name)
        loaded: Any = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        raise ConfigError(f"cannot convert GGUF file {src / name}: {type(e).__name__}: {e}") from e
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32  # dequantized values are exact in float32, not in bfloat16
    with torch.device("meta"):  # no random init for weights about to be replaced
        fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    if config.tie_word_embeddings:
        fresh.tie_weights()
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
