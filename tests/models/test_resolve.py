"""``resolve_model_path``: folders as they are, Hugging Face ids from a hub cache this test writes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pdserve.config.cluster import ClusterConfig
from pdserve.errors import ConfigError
from pdserve.models.config import ModelArchConfig
from pdserve.models.resolve import looks_like_hf_id, resolve_model_path

REV = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(root: Path, repo_id: str, checkpoint: Path, *, with_ref: bool = True) -> Path:
    """``checkpoint`` laid out as huggingface_hub stores a download: models--Org--Name/snapshots/<rev>."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REV
    shutil.copytree(checkpoint, snapshot)
    if with_ref:
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(REV)
    return snapshot


@pytest.mark.parametrize("with_ref", [True, False])
def test_an_hf_id_resolves_from_the_cache(tiny_models, tmp_path, monkeypatch, with_ref) -> None:
    snapshot = _hub_cache(tmp_path / "hub", "TinyOrg/Tiny-Llama", tiny_models["llama"], with_ref=with_ref)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # no folder named TinyOrg/Tiny-Llama here
    got = resolve_model_path("TinyOrg/Tiny-Llama")
    assert got.resolve() == snapshot.resolve()
    assert ModelArchConfig.from_model_dir(got).num_hidden_layers == 2


def test_hf_home_is_the_fallback(tiny_models, tmp_path, monkeypatch) -> None:
    snapshot = _hub_cache(tmp_path / "home" / "hub", "TinyOrg/Other", tiny_models["llama"])
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("TinyOrg/Other").resolve() == snapshot.resolve()


def test_an_absent_id_names_the_id_and_the_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        resolve_model_path("Qwen/Qwen3-0.6B")
    assert "'Qwen/Qwen3-0.6B'" in str(e.value) and str(tmp_path / "hub") in str(e.value)


def test_folders_pass_and_nonsense_is_refused(tiny_models, tmp_path, monkeypatch) -> None:
    assert resolve_model_path(tiny_models["llama"]) == tiny_models["llama"]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"/no/such/folder does not exist; name a checkpoint folder, a \.gguf file or a Hugging Face id",
    ):
        resolve_model_path("/no/such/folder")
    assert looks_like_hf_id("Org/Name") and not looks_like_hf_id("/abs/path")
    assert not looks_like_hf_id("a/b/c")


def test_an_hf_id_is_served_under_its_name() -> None:
    c = ClusterConfig.from_dict(
        {
            "model": "Org/Name",
            "nodes": [
                {"name": "c", "role": "colocated", "host": "127.0.0.1", "grpc_port": 1, "metrics_port": 2}
            ],
        }
    )
    assert c.served_name("Org/Name") == "Org/Name"
    assert c.served_name("/ckpt/m") == "m"
