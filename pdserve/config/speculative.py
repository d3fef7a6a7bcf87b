"""The ``speculative:`` setting of a node (cluster file) and of ``LLM(...)``. No torch.

speculative:
  method: ngram                 # ngram | draft_model | mtp; anything else is refused at start
  num_speculative_tokens: 3     # k: draft tokens verified per step and request
  prompt_lookup_min: 1          # ngram: shortest suffix n-gram looked up in the request's tokens
  prompt_lookup_max: 4          # ngram: longest (tried first)
  model: null                   # draft_model: the draft checkpoint (a folder, .gguf or hub id);
                                #   same tokenizer as the target, refused at start otherwise
  disable_by_batch_size: null   # from this many requests running on, no drafts (null: never)

``mtp`` reads its module from the target checkpoint (``num_nextn_predict_layers`` in config.json,
weights as extra layers: pdserve/models/mtp.py); a checkpoint without one is refused at start.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.errors import ConfigError

SUPPORTED_METHODS = ("ngram", "draft_model", "mtp")
# Methods other engines know; named in the refusal so a user sees it is a known-but-unbuilt one.
KNOWN_UNBUILT_METHODS = ("eagle", "eagle3", "medusa")
NGRAM_ONLY = ("prompt_lookup_min", "prompt_lookup_max")
FIELDS = ("method", "num_speculative_tokens", *NGRAM_ONLY, "model", "disable_by_batch_size")

# (folder, (name, size, mtime_ns) of every file hashed) -> content id: a node computes it once.
_content_ids: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}
_lock = threading.Lock()


def checkpoint_content_id(model: str) -> str:
    """sha256 (16 hex digits) over a checkpoint's config.json, tokenizer files and weights' bytes:
    equal only for the same weights, whatever the folder's path on each host."""
    from pdserve.models.resolve import file_sha256, resolve_model_path

    d = resolve_model_path(model)
    names = ["config.json", "tokenizer.json", *sorted(p.name for p in d.glob("*.safetensors"))]
    files = [d / n for n in names if (d / n).is_file()]
    key = (str(d.resolve()), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    with _lock:
        if key not in _content_ids:
            h = hashlib.sha256()
            for f in files:
                h.update(f"{f.name}:{file_sha256(Path(f))}\n".encode())
            _content_ids[key] = h.hexdigest()[:16]
        return _content_ids[key]


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # Under load a verification step costs more than the tokens it saves (every row computes
    # 1 + m tokens): from this many running requests on, steps run without drafts. None: never.
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model: the draft checkpoint

    def __post_init__(self) -> None:
        if self.method not in SUPPORTED_METHODS:
            known = " (known, not built here)" if self.method in KNOWN_UNBUILT_METHODS else ""
            raise ConfigError(
                f"speculative.method {self.method!r}{known} is not supported; supported: "
                f"{', '.join(SUPPORTED_METHODS)}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(
                f"speculative.num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                "speculative: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ConfigError(
                f"speculative.disable_by_batch_size must be >= 1 or unset, got {self.disable_by_batch_size}"
            )
        if self.method == "draft_model" and not self.model:
            raise ConfigError("speculative.method draft_model needs model: the draft checkpoint's folder")
        if self.method != "draft_model" and self.model is not None:
            raise ConfigError(
                f"speculative.model ({self.model!r}) is read by method draft_model only, not "
                f"{self.method!r}; remove it"
            )

    @property
    def drafter_identity(self) -> str:
        """What names the drafter (the P/D handshake compares it): n-gram has no weights, a draft
        model is named by its checkpoint's content, an MTP module by its depth (its weights are
        the target checkpoint's, which the handshake's model identity already compares)."""
        if self.method == "draft_model":
            assert self.model is not None
            return f"draft_model[{checkpoint_content_id(self.model)}]"
        if self.method == "mtp":
            return "mtp[1]"
        return f"ngram[{self.prompt_lookup_min},{self.prompt_lookup_max}]"

    @classmethod
    def from_value(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """A mapping (``LLM(speculative={...})``, a cluster file) or a config; None stays None.
        An unknown key is refused with the keys that exist, and an n-gram setting given to
        another method (it would not act on it)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"speculative must be a mapping of settings, got {type(value).__name__}")
        unknown = sorted(set(value) - set(FIELDS))
        if unknown:
            raise ConfigError(f"speculative: unknown setting(s) {unknown}; known: {', '.join(FIELDS)}")
        check_ngram_only(str(value.get("method", "ngram")), set(value))
        return cls(**dict(value))


def check_ngram_only(method: str, given: set[str]) -> None:
    """ConfigError when an n-gram-only setting is given to another method."""
    stray = sorted(given & set(NGRAM_ONLY))
    if method != "ngram" and stray:
        raise ConfigError(
            f"speculative: {', '.join(stray)} apply to method ngram only, not {method!r}; remove them"
        )
