"""The LLaVA model (CLIP tower + projector + Llama decoder) against transformers, on the tiny
random checkpoint of ``make_tiny_model("llava")``; per-item image placeholders and block salting."""

from __future__ import annotations

import hashlib

import pytest
import torch

from pdserve.engine.request import MultiModalItem
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError
from pdserve.models.llava import expand_image_placeholders
from pdserve.models.make_model import IMAGE_TOKEN

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory):
    from pdserve.models.make_model import make_tiny_model

    return make_tiny_model("llava", tmp_path_factory.mktemp("llava"))


def _images(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))  # pixel values


def _prompt(tok, text: str, num_images: int, n_img: int, image_id: int) -> tuple[list[int], list[int]]:
    ids = tok.encode(f"{IMAGE_TOKEN * num_images}\n{text}", add_special_tokens=False)
    return expand_image_placeholders(ids, image_id, n_img)


def _items(model, ids_offsets, pixels: torch.Tensor) -> list[MultiModalItem]:
    embeds = model.encode_images(pixels)  # [k, T, hidden]
    _ids, offsets = ids_offsets
    return [
        MultiModalItem(off, embeds.shape[1], hashlib.blake2b(pixels[i].numpy().tobytes()).digest(), embeds[i])
        for i, off in enumerate(offsets)
    ]


def _run(llm, reqs: list[tuple[list[int], list[MultiModalItem]]]) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {}
    for i, (ids, items) in enumerate(reqs):
        llm.engine.add_request(ids, params, f"r{i}", mm_items=items)
        out[f"r{i}"] = []
    while llm.engine.has_unfinished():
        for d in llm.engine.step():
            out[d.request_id].extend(d.token_ids)
    return out


def test_image_features_match_transformers(llava_dir) -> None:
    from transformers import LlavaForConditionalGeneration

    from pdserve.models.loader import load_model

    model, _ = load_model(llava_dir, torch.float32, "cpu")
    ref = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    px = _images(2, 0)
    with torch.no_grad():
        want = ref.get_image_features(pixel_values=px)
        want = getattr(want, "pooler_output", want)
        want = torch.stack(list(want)) if isinstance(want, (list, tuple)) else want
        got = model.encode_images(px)
    assert got.shape == (2, model.num_image_tokens, model.cfg.hidden_size)
    torch.testing.assert_close(got, want.view(got.shape), rtol=1e-5, atol=1e-5)


def test_engine_greedy_matches_transformers_generate(llava_dir, make_llm) -> None:
    """4 concurrent requests with different images, and one with two images in one prompt."""
    from transformers import LlavaForConditionalGeneration

    from pdserve.models.loader import load_model

    llm = make_llm(llava_dir, device="cpu", dtype="float32")
    model = load_model(llava_dir, torch.float32, "cpu")[0]  # the encoder's copy of the vision parts
    tok = llm.tokenizer
    texts = ["What is in the picture?", "Describe it.", "Count the foxes.", "Say hello"]
    cases = [
        (_prompt(tok, t, 1, model.num_image_tokens, model.image_token_id), _images(1, 10 + i))
        for i, t in enumerate(texts)
    ]
    cases.append(
        (_prompt(tok, "Compare the two.", 2, model.num_image_tokens, model.image_token_id), _images(2, 99))
    )
    with torch.no_grad():
        reqs = [(io[0], _items(model, io, px)) for io, px in cases]
    got = _run(llm, reqs)

    ref = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    for i, ((ids, _offs), px) in enumerate(cases):
        with torch.no_grad():
            g = ref.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                pixel_values=px,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
        assert got[f"r{i}"] == g[0, len(ids) :].tolist(), f"request {i}"


def test_same_text_other_image_shares_no_blocks(llava_dir, make_llm) -> None:
    llm = make_llm(llava_dir, device="cpu", dtype="float32")
    from pdserve.models.loader import load_model

    model = load_model(llava_dir, torch.float32, "cpu")[0]
    io = _prompt(
        llm.tokenizer,
        "The same question about the image, asked twice over.",
        1,
        model.num_image_tokens,
        model.image_token_id,
    )
    with torch.no_grad():
        a, b = _items(model, io, _images(1, 1)), _items(model, io, _images(1, 2))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    cached = {}
    outs = {}
    for rid, items in (("a", a), ("a2", a), ("b", b)):
        req = llm.engine.add_request(io[0], params, rid, mm_items=items)
        toks: list[int] = []
        while llm.engine.has_unfinished():
            for d in llm.engine.step():
                toks.extend(d.token_ids)
        cached[rid], outs[rid] = req.num_cached_tokens, toks
    assert cached["a2"] > 0, "the same image and text reuse the prefix cache"
    assert cached["b"] == 0, "another image must share no block (the image starts at position 0)"
    assert outs["a"] == outs["a2"] and outs["a"] != outs["b"]


def test_bad_items_are_refused(llava_dir, make_llm) -> None:
    llm = make_llm(llava_dir, device="cpu", dtype="float32")
    h = llm.engine.arch.hidden_size
    ids = [5] * 20
    params = SamplingParams(max_tokens=2)
    bad = [
        MultiModalItem(0, 16, b"x", torch.zeros(15, h)),  # wrong shape
        MultiModalItem(0, 16, b"x", torch.zeros(16, h, dtype=torch.int64)),  # not float
        MultiModalItem(0, 16, b"x", torch.full((16, h), float("nan"))),  # NaN
        MultiModalItem(10, 16, b"x", torch.zeros(16, h)),  # runs past the prompt
    ]
    for item in bad:
        with pytest.raises(InvalidRequestError):
            llm.engine.add_request(ids, params, mm_items=[item])
    assert not llm.engine.has_unfinished()
