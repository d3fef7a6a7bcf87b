"""Session-wide fixtures shared by all test packages.

Tiny random checkpoints (``pdserve.models.make_model.make_tiny_model``: a transformers-built
model in safetensors + a byte-level BPE tokenizer with ChatML template), built once per session:

    def test_x(tiny_models):                  # lazy mapping arch -> Path, default sizes
        model_dir = tiny_models["qwen3"]      # "llama" | "qwen2" | "qwen3"

    def test_y(tiny_model_factory):           # any make_tiny_model keyword overrides
        model_dir = tiny_model_factory("llama", num_layers=4, vocab_size=1024)

Defaults: hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16, vocab 512, fp32; Qwen archs
tie embeddings, Llama does not. Treat the folders as read-only: they are shared by every test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

TinyModelFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """``factory(arch, **overrides) -> Path``, cached per (arch, overrides) for the session."""
    from pdserve.models.make_model import make_tiny_model

    cache: dict[tuple[str, tuple[tuple[str, Any], ...]], Path] = {}

    def factory(arch: str, **overrides: Any) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = make_tiny_model(arch, out, **overrides)
        return cache[key]

    return factory


class _LazyTinyModels(Mapping[str, Path]):
    """arch -> default tiny checkpoint; each is built on first access only."""

    ARCHS = ("llama", "qwen2", "qwen3")

    def __init__(self, factory: TinyModelFactory) -> None:
        self._factory = factory

    def __getitem__(self, arch: str) -> Path:
        if arch not in self.ARCHS:
            raise KeyError(arch)
        return self._factory(arch)

    def __iter__(self) -> Iterator[str]:
        return iter(self.ARCHS)

    def __len__(self) -> int:
        return len(self.ARCHS)


@pytest.fixture(scope="session")
def tiny_models(tiny_model_factory: TinyModelFactory) -> Mapping[str, Path]:
    """Lazy mapping "llama" / "qwen2" / "qwen3" -> default tiny checkpoint folder."""
    return _LazyTinyModels(tiny_model_factory)


@pytest.fixture
def make_llm() -> Iterator[Callable[..., Any]]:
    """Build ``LLM`` instances; at teardown every one must have its block pool fully free."""
    from pdserve.engine.llm import LLM

    made: list[LLM] = []

    def factory(model_dir: Any, **kwargs: Any) -> LLM:
        # float32 unless a test asks otherwise: "auto" is float32 on CPU but bf16 on CUDA, and the
        # parity tests (transformers, PEFT) compare at float32 near-ties on a GPU host too.
        kwargs.setdefault("dtype", "float32")
        llm = LLM(str(model_dir), **kwargs)
        made.append(llm)
        return llm

    yield factory
    for llm in made:
        eng = llm.engine
        eng.kv.process_deferred_frees()
        assert not eng.has_unfinished(), "requests left unfinished"
        assert eng.kv.pool.num_used_blocks == 0, f"{eng.kv.pool.num_used_blocks} KV blocks still held"
        assert eng.kv.num_held_requests == 0
        eng.close()  # e.g. the runner's bitmask filler thread
    made.clear()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
