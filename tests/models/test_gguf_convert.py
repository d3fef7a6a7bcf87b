"""A tiny llama GGUF, written here with the ``gguf`` package's writer the way llama.cpp's
convert_hf_to_gguf.py lays it out (Q/K rows permuted), converts back into the HF tensors."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pdserve.errors import ConfigError
from pdserve.models import gguf_convert, resolve
from pdserve.models.make_model import make_tiny_model

gguf = pytest.importorskip("gguf")

HEADS, KV_HEADS = 4, 2
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's row order for q/k (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in top or hf == "lm_head.weight":
        return top.get(hf, "output.weight")
    _, _, layer, rest = hf.split(".", 3)  # model.layers.<i>.<module>.weight
    module = rest.rsplit(".", 1)[0]
    return f"blk.{layer}.{GGUF_NAMES[module]}.weight"


def write_tiny_gguf(hf_dir: Path, path: Path, arch: str = "llama") -> dict[str, torch.Tensor]:
    """The checkpoint in ``hf_dir`` as a float32 GGUF at ``path``; returns its HF tensors."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {a["id"]: a["content"] for a in tok["added_tokens"]}
    tokens = [t for t, _ in vocab] + [added[i] for i in sorted(added) if i >= len(vocab)]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), cfg["vocab_size"])]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_chat_template(CHAT_TEMPLATE)
    for name, t in tensors.items():
        data = t
        if name.endswith("q_proj.weight"):
            data = _permute(t, HEADS)
        elif name.endswith("k_proj.weight"):
            data = _permute(t, KV_HEADS)
        w.add_tensor(_gguf_name(name), data.float().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("gguf")
    hf_dir = make_tiny_model("llama", root / "hf", num_heads=HEADS, num_kv_heads=KV_HEADS)
    path = root / "tiny-llama.gguf"
    return hf_dir, path, write_tiny_gguf(hf_dir, path)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(resolve, "_resolved_gguf", {})  # no hit from another test's conversion
    return tmp_path / "cache"


def test_tensors_round_trip_without_unpickling(tiny_gguf, cache_dir, monkeypatch) -> None:
    hf_dir, path, tensors = tiny_gguf

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF conversion unpickled something")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    out = resolve.resolve_model_path(path)
    monkeypatch.undo()
    assert out.parent == cache_dir / "gguf" and out.name.startswith("tiny-llama-")
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(tensors)
    for name, t in tensors.items():  # q/k permutation undone, float32 values exact
        assert torch.equal(got[name], t.float()), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (2, 64)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (HEADS, KV_HEADS)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == json.loads((hf_dir / "config.json").read_text())["eos_token_id"]

    from transformers import AutoTokenizer

    ref, conv = AutoTokenizer.from_pretrained(hf_dir), AutoTokenizer.from_pretrained(out)
    text = "def add(a, b):\n    return a + b"
    assert conv.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    prompt = conv.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert prompt == "<|user|>hi\n<|assistant|>"


def test_the_engine_serves_the_gguf_like_transformers(tiny_gguf, cache_dir, make_llm) -> None:
    from transformers import AutoModelForCausalLM

    from pdserve.engine.sampling_params import SamplingParams

    _, path, _ = tiny_gguf
    llm = make_llm(str(path), dtype="float32", device="cpu")
    prompt = [5, 17, 42, 9, 100]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0]
    ref = AutoModelForCausalLM.from_pretrained(resolve.resolve_model_path(path), dtype=torch.float32)
    ids = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert out.token_ids == ids[0, len(prompt) :].tolist()


def test_a_converted_folder_is_reused(tiny_gguf, cache_dir, monkeypatch) -> None:
    _, path, _ = tiny_gguf
    first = resolve.resolve_model_path(path)
    monkeypatch.setattr(resolve, "_resolved_gguf", {})  # as a new process would: hash again

    def convert_again(*args: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_convert, "_dequantize", convert_again)
    assert resolve.resolve_model_path(path) == first


def test_a_concurrent_winner_is_taken(tiny_gguf, cache_dir, tmp_path, monkeypatch) -> None:
    """Another process renamed its folder into place while this one converted: this one's copy
    is dropped and the winner's folder returned."""
    _, path, _ = tiny_gguf
    out = tmp_path / "cache" / "gguf" / "target"
    real = gguf_convert._dequantize

    def convert_while_another_wins(src: Path, name: str, built: Path) -> None:
        real(src, name, built)
        out.mkdir(parents=True)
        (out / gguf_convert.MARKER).write_text("{}")
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_convert, "_dequantize", convert_while_another_wins)
    assert gguf_convert.convert_gguf(path, out) == out
    assert json.loads((out / "config.json").read_text()) == {}  # the winner's, untouched
    assert [p.name for p in out.parent.iterdir()] == ["target"]  # no temporary folder left


def test_an_unsupported_architecture_names_the_file(tmp_path, cache_dir) -> None:
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        ConfigError, match=r"m\.gguf holds a 'mamba' model; supported GGUF architectures: llama"
    ):
        resolve.resolve_model_path(path)


def test_a_corrupt_file_names_the_file(tmp_path, cache_dir) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match=r"cannot read GGUF file .*broken\.gguf"):
        resolve.resolve_model_path(path)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve.resolve_model_path(tmp_path / "missing.gguf")


def test_pdserve_serve_names_a_corrupt_gguf_and_exits_2(tmp_path, cache_dir) -> None:
    from typer.testing import CliRunner

    from services.cli import app

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    cfg = tmp_path / "c.yaml"
    node = {"name": "c", "role": "colocated", "host": "127.0.0.1", "grpc_port": 1, "metrics_port": 2}
    cfg.write_text(json.dumps({"model": str(bad), "nodes": [node]}))  # JSON is YAML
    r = CliRunner().invoke(app, ["serve", "colocated", "--config", str(cfg), "--node", "c"])
    assert r.exit_code == 2, r.output
    assert f"error: cannot read GGUF file {bad}" in r.output
