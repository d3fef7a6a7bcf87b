"""Tiny random HF checkpoints (model + byte-level BPE tokenizer) for tests and demos.

Built with ``transformers`` itself, so loading them with our loader and comparing against
``AutoModelForCausalLM`` checks our model code against the reference implementation.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "qwen3", "llava", "gemma3", "mixtral", "qwen3_moe", "lfm2")
# The tiny Gemma-3: sliding-window layers (this window) interleaved with full-attention ones.
TINY_SLIDING_WINDOW = 32
# The tiny LFM2: depthwise causal convolutions of this kernel beside attention layers.
TINY_CONV_KERNEL = 3
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
IMAGE_TOKEN = "<image>"  # LLaVA's placeholder; one per image patch in the prompt
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The tiny MoE families: experts, experts per token, a Qwen3-MoE expert's MLP rows (Mixtral's
# experts have intermediate_size rows, Qwen3-MoE's dense layers too). The tiny Qwen3-MoE
# keeps its last layer dense (mlp_only_layers) and its top-k weights unnormalised
# (norm_topk_prob false), so both of its departures from Mixtral are exercised.
TINY_MOE = {"num_experts": 8, "top_k": 2, "moe_intermediate_size": 32}
# Larger than transformers' 0.02 so random logits are spread out: with 0.02 the logit std is
# ~0.15 and greedy top-2 near-ties (which make token-equality tests flaky) become common.
INITIALIZER_RANGE = 0.2

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Disaggregated serving splits prefill and decode across machines; the KV cache moves between them.",
    "Once upon a time, there was a little model that wanted to generate text one token at a time.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i))\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 -7 1e-5",
    "User: What is the capital of France?\nAssistant: The capital of France is Paris.",
    '{"role": "user", "content": "Hello, world!"} <tag attr="x">text</tag>',
    "Punctuation & symbols: !@#$%^&*()[]{};:'\",.<>/?\\|`~ -_=+",
    "Schnelle braune Füchse, café crème, naïve façade, 東京, привет, مرحبا 🙂",
]


def _train_tokenizer(vocab_size: int, extra_special: tuple[str, ...] = ()):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + list(extra_special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _hf_config(arch: str, eos_id: int, **kw):  # -> transformers.PretrainedConfig
    from transformers import (
        Gemma3TextConfig,
        Lfm2Config,
        LlamaConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    # No pad_token_id: transformers would zero that embedding row (padding_idx), and pad = eos here.
    common = dict(
        initializer_range=INITIALIZER_RANGE, bos_token_id=None, eos_token_id=eos_id, pad_token_id=None, **kw
    )
    if arch == "llama":
        return LlamaConfig(architectures=["LlamaForCausalLM"], **common)
    if arch == "llava":  # the decoder of the tiny LLaVA; make_tiny_model wraps it
        return LlamaConfig(**common)
    if arch == "gemma3":
        n = kw["num_hidden_layers"]
        return Gemma3TextConfig(
            architectures=["Gemma3ForCausalLM"],
            layer_types=["full_attention" if i % 2 else "sliding_attention" for i in range(n)],
            sliding_window=TINY_SLIDING_WINDOW,
            query_pre_attn_scalar=kw["head_dim"],
            **common,
        )
    if arch == "lfm2":  # short convolutions (kernel 3) with an attention layer every third
        n = kw["num_hidden_layers"]
        lfm = {k: v for k, v in common.items() if k not in ("head_dim", "rms_norm_eps")}
        return Lfm2Config(
            architectures=["Lfm2ForCausalLM"],
            layer_types=["full_attention" if i % 3 == 1 else "conv" for i in range(n)],
            conv_L_cache=TINY_CONV_KERNEL,
            conv_bias=True,
            block_auto_adjust_ff_dim=False,
            norm_eps=kw["rms_norm_eps"],
            **lfm,
        )
    if arch == "qwen2":
        return Qwen2Config(architectures=["Qwen2ForCausalLM"], **common)
    if arch == "mixtral":
        return MixtralConfig(
            architectures=["MixtralForCausalLM"],
            num_local_experts=TINY_MOE["num_experts"],
            num_experts_per_tok=TINY_MOE["top_k"],
            sliding_window=None,
            **common,
        )
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            architectures=["Qwen3MoeForCausalLM"],
            num_experts=TINY_MOE["num_experts"],
            num_experts_per_tok=TINY_MOE["top_k"],
            moe_intermediate_size=TINY_MOE["moe_intermediate_size"],
            norm_topk_prob=False,
            mlp_only_layers=[kw["num_hidden_layers"] - 1],
            **common,
        )
    return Qwen3Config(architectures=["Qwen3ForCausalLM"], **common)


def make_tiny_model(
    arch: str,
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool | None = None,
    seed: int = 0,
    dtype: str = "float32",
    mtp: bool = False,
) -> Path:
    """Write a random ``arch`` checkpoint (config, safetensors, tokenizer, generation config).

    Deterministic for a given seed. ``tie_word_embeddings`` defaults to True for the Qwen archs
    (as in the small Qwen releases) and False for Llama and Mixtral, so both load paths are exercised.
    Norm weights and biases are randomised too (transformers initialises them to 1 and 0, which
    would hide a missing or misplaced norm/bias). ``mtp``: add a one-layer DeepSeek-V3-style MTP
    module (``num_nextn_predict_layers: 1``, weights as layer ``num_layers``: models/mtp.py).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is not one of {ARCHS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer(vocab_size, (IMAGE_TOKEN,) if arch == "llava" else ())
    assert len(tokenizer) <= vocab_size, f"tokenizer has {len(tokenizer)} tokens > vocab_size {vocab_size}"
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)

    if tie_word_embeddings is None:
        tie_word_embeddings = arch not in ("llama", "mixtral")
    cfg = _hf_config(
        arch,
        eos_id,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    if arch == "llava":
        model = _tiny_llava(cfg, tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), out)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
    model = model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _ensure_chat_template_in_tokenizer_config(out)
    if mtp:
        from pdserve.models.mtp import write_mtp_weights

        write_mtp_weights(out, seed, INITIALIZER_RANGE)
    return out


# The tiny CLIP tower: 16x16 images in 4x4 patches -> 16 image tokens per image.
TINY_IMAGE_SIZE = 16
TINY_PATCH_SIZE = 4
TINY_PREPROCESSOR = {  # CLIPImageProcessor's keys and OpenAI CLIP's statistics
    "image_processor_type": "CLIPImageProcessor",
    "do_resize": True,
    "size": {"shortest_edge": TINY_IMAGE_SIZE},
    "resample": 3,  # bicubic
    "do_center_crop": True,
    "crop_size": {"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True,
}


def _tiny_llava(text_cfg, image_token_id: int, out: Path):  # -> LlavaForConditionalGeneration
    """A random LLaVA around ``text_cfg`` (CLIP tower, as transformers' LlavaConfig default), and
    its image processor config (CLIPImageProcessor, saved offline as preprocessor_config.json)."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=TINY_IMAGE_SIZE,
        patch_size=TINY_PATCH_SIZE,
        initializer_range=INITIALIZER_RANGE,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text_cfg,
        image_token_index=image_token_id,
        image_seq_length=(TINY_IMAGE_SIZE // TINY_PATCH_SIZE) ** 2,
        tie_word_embeddings=text_cfg.tie_word_embeddings,
        architectures=["LlavaForConditionalGeneration"],
    )
    # Written by hand: CLIPImageProcessor needs torchvision to be built, which would pull another torch.
    (out / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=2) + "\n")
    return LlavaForConditionalGeneration(cfg).float()


def _ensure_chat_template_in_tokenizer_config(out: Path) -> None:
    """transformers v5 may save the template as chat_template.jinja; keep a copy where v4 looks."""
    path = out / "tokenizer_config.json"
    data = json.loads(path.read_text())
    if "chat_template" not in data:
        data["chat_template"] = CHATML_TEMPLATE
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
