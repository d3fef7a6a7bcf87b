"""Drafters with weights in the engine (LLM, in process) against the same engine without
speculation: a draft model (a tinier random Llama with the target's tokenizer, and the target
itself as its own draft, which must have nearly every draft accepted) and a one-layer MTP module
shipped in the target checkpoint (checked against transformers, then greedy parity). Greedy
tokens equal, max_tokens never passed, no KV block held afterwards; refusals at start."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import ConfigError

FULL = bool(os.environ.get("PDSERVE_FULL_TESTS"))
# Prompts that repeat a span, of various lengths; max_tokens from 1 up.
PROMPTS = [[(i * 7 + j) % 50 + 5 for j in range(3 + i * 5)] * 3 for i in range(8)]
MAX_TOKENS = [1, 2, 5, 37, 80, 150, 230, 300] if FULL else [1, 2, 5, 13, 24, 32, 40, 48]
TINY_DRAFT = {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64}


def _greedy(llm: Any) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def baseline(tiny_models: Any) -> list[list[int]]:
    from pdserve.engine.llm import LLM

    with LLM(str(tiny_models["llama"]), device="cpu", max_model_len=512) as llm:
        return _greedy(llm)


def test_draft_model_greedy_equal(
    make_llm: Any, tiny_models: Any, tiny_model_factory: Any, baseline: Any
) -> None:
    draft = tiny_model_factory("llama", **TINY_DRAFT, seed=5)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = make_llm(tiny_models["llama"], device="cpu", max_model_len=512, speculative=spec)
    got = _greedy(llm)
    assert got == baseline and [len(t) for t in got] == MAX_TOKENS
    stats = llm.engine.spec.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert llm.engine.runner.drafter.num_computed == {}  # state dropped with the requests


def test_the_target_as_its_own_draft_is_accepted(make_llm: Any, tiny_models: Any, baseline: Any) -> None:
    """The draft's KV catch-up is right only if a draft equal to the target drafts exactly its
    greedy tokens: nearly every draft is accepted (fp32 rounding between batch shapes aside)."""
    target = str(tiny_models["llama"])
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 4}
    llm = make_llm(target, device="cpu", max_model_len=512, speculative=spec)
    assert _greedy(llm) == baseline
    st = llm.engine.spec.stats
    assert st.num_draft_tokens > 100 and st.num_accepted_tokens >= 0.97 * st.num_draft_tokens, st
    assert sum(st.accepted_per_pos) == st.num_accepted_tokens


def test_draft_model_refusals(tiny_models: Any, tiny_model_factory: Any) -> None:
    from pdserve.engine.llm import LLM

    target = str(tiny_models["llama"])
    other = tiny_model_factory("llama", **TINY_DRAFT, vocab_size=400)  # another BPE vocabulary
    with pytest.raises(ConfigError, match="tokenizer differs from the target's"):
        LLM(target, device="cpu", speculative={"method": "draft_model", "model": str(other)})
    with pytest.raises(ConfigError, match="needs model"):
        LLM(target, device="cpu", speculative={"method": "draft_model"})
    with pytest.raises(ConfigError, match="read by method draft_model only"):
        LLM(target, device="cpu", speculative={"method": "ngram", "model": target})
    with pytest.raises(ConfigError, match="prompt_lookup_max apply to method ngram only"):
        LLM(target, device="cpu", speculative={"method": "mtp", "prompt_lookup_max": 3})
    with pytest.raises(ConfigError, match="num_nextn_predict_layers: 1"):
        LLM(target, device="cpu", speculative={"method": "mtp"})  # no MTP module in it


@pytest.fixture(scope="module")
def mtp_model(tiny_model_factory: Any) -> Any:
    return tiny_model_factory("llama", mtp=True)


def test_mtp_module_matches_transformers(make_llm: Any, mtp_model: Any) -> None:
    """The first draft after a prompt: our MTP module over (h_i, t_{i+1}) for every prompt
    position against a reference built from transformers (a one-layer Llama whose input is
    eh_proj(cat(enorm(e), hnorm(h))) and whose final norm is the shared head's)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    llm = make_llm(mtp_model, device="cpu", max_model_len=512, speculative={"method": "mtp"})
    prompt = PROMPTS[3]
    eng = llm.engine
    eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), "m")
    eng.step()  # the prompt: the MTP module's KV for it, d_1 from its last row
    req = eng.scheduler.requests["m"]
    st = eng.runner.drafter.states["m"]
    assert st.num_computed == len(prompt) and st.hidden is not None
    ours = eng.runner.drafter.module.compute_logits(st.hidden[None]).float()[0]
    while eng.has_unfinished():
        eng.step()

    hf = AutoModelForCausalLM.from_pretrained(str(mtp_model), dtype=torch.float32).eval()
    w = load_file(str(next(mtp_model.glob("*.safetensors"))))
    n_layers = hf.config.num_hidden_layers
    pre = f"model.layers.{n_layers}."
    ids = torch.tensor([prompt + [req.output_token_ids[0]]])

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf.config.rms_norm_eps) * weight

    with torch.no_grad():
        h = hf.model(ids[:, :-1]).last_hidden_state  # [1, P, H] after the final norm
        e = hf.model.embed_tokens(ids[:, 1:])
        x = torch.cat([rms(e, w[pre + "enorm.weight"]), rms(h, w[pre + "hnorm.weight"])], -1)
        x = x @ w[pre + "eh_proj.weight"].T
        cfg = LlamaConfig(**{**hf.config.to_dict(), "num_hidden_layers": 1})
        ref = LlamaForCausalLM(cfg).eval()
        layer = {k.removeprefix(pre): v for k, v in w.items() if k.startswith(pre)}
        sd = {f"model.layers.0.{k}": v for k, v in layer.items() if not k.startswith(("e", "h", "shared"))}
        sd |= {"model.norm.weight": w[pre + "shared_head.norm.weight"], "lm_head.weight": w["lm_head.weight"]}
        sd["model.embed_tokens.weight"] = w["model.embed_tokens.weight"]
        ref.load_state_dict(sd)
        want = ref(inputs_embeds=x).logits[0, -1]
    torch.testing.assert_close(ours, want, atol=2e-4, rtol=1e-4)


def test_mtp_greedy_equal(make_llm: Any, mtp_model: Any) -> None:
    from pdserve.engine.llm import LLM

    with LLM(str(mtp_model), device="cpu", max_model_len=512) as base:
        want = _greedy(base)
    llm = make_llm(
        mtp_model, device="cpu", max_model_len=512, speculative={"method": "mtp", "num_speculative_tokens": 3}
    )
    got = _greedy(llm)
    assert got == want and [len(t) for t in got] == MAX_TOKENS
    st = llm.engine.spec.stats
    # A random module's drafts are rarely accepted (2 of 426 here); the module's correctness is
    # test_mtp_module_matches_transformers and test_mtp_kv_moves_from_prefill_to_decode.
    assert st.num_drafts > 0 and st.num_draft_tokens >= st.num_drafts, st
    assert llm.engine.runner.drafter.states == {}


def test_mtp_kv_moves_from_prefill_to_decode(mtp_model: Any) -> None:
    """The P/D path in process: a prefill engine computes the MTP module's KV for the prompt; the
    regions a transfer pairs by name (the target's layers and the MTP layer) are copied into a
    decode engine's blocks with the transfer's descriptors. The decode engine's first step then
    gives the MTP module's output at position P equal to a colocated engine's (which computed
    every position itself), and its greedy tokens equal those without speculation."""
    import ctypes

    from pdserve.config.choices import KvLoadFailurePolicy
    from pdserve.config.engine import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.kvtransfer.params import RemoteDecodeParams, RemotePrefillParams
    from pdserve.kvtransfer.regions import align_regions, build_descriptors
    from pdserve.kvtransfer.runner_kv import kv_regions_of

    prompt, max_tokens = PROMPTS[4], 24
    cfg = EngineConfig(model=str(mtp_model), device="cpu", max_model_len=512, speculative={"method": "mtp"})
    held: list[tuple[list[int], list[int]]] = []  # (first tokens, blocks)
    prefill = LLMEngine(
        cfg,
        on_hold_for_transfer=lambda r, blocks: held.append((list(r.output_token_ids), list(blocks))) or True,
    )
    decode = LLMEngine(cfg)
    colo = LLMEngine(cfg)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        prefill.add_request(
            prompt,
            SamplingParams(temperature=0.0, max_tokens=1),
            "p",
            kv_transfer_params=RemoteDecodeParams("t"),
        )
        prefill.step()
        ((first, src_blocks),) = held
        loads: list[Any] = []
        decode.kv_loads.sink = loads.extend
        decode.add_request(
            prompt,
            greedy,
            "d",
            kv_transfer_params=RemotePrefillParams("t", "p:1"),
            output_token_ids=list(first),
        )
        got = [t for dlt in decode.step() for t in dlt.token_ids]
        (load,) = loads
        pairs = align_regions(kv_regions_of(prefill.runner), kv_regions_of(decode.runner))
        mtp_layer = f"model.layers.{decode.arch.num_hidden_layers}.self_attn"
        assert mtp_layer in {s.layer_name for s, _ in pairs}
        n_blocks = -(-load.num_tokens // decode.cache_sizes.block_size)
        for src, dst, nbytes in build_descriptors(pairs, src_blocks[:n_blocks], load.block_ids[:n_blocks]):
            ctypes.memmove(dst, src, nbytes)
        decode.finish_kv_load("d", True, KvLoadFailurePolicy.FAIL)
        got += [t for dlt in decode.step() for t in dlt.token_ids]  # position P: h_P, then g
        g_decode = decode.runner.drafter.states["d"].hidden
        # "c" (max_tokens 2): its second step (position P) has no room for drafts, so its g is
        # P's; "c2" keeps the engine busy, so c's state is read before it is dropped.
        colo.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), "c")
        colo.add_request(prompt, greedy, "c2")
        deltas = colo.step() + colo.step()
        g_colo = colo.runner.drafter.states["c"].hidden
        assert g_decode is not None and g_colo is not None
        torch.testing.assert_close(g_decode, g_colo, atol=1e-5, rtol=1e-5)
        while colo.has_unfinished():
            deltas += colo.step()
        want = [t for dlt in deltas if dlt.request_id == "c2" for t in dlt.token_ids]
        while decode.has_unfinished():
            got += [t for dlt in decode.step() for t in dlt.token_ids]
        assert list(first) + got == want and len(want) == max_tokens
        assert decode.spec is not None and decode.spec.stats.num_drafts > 0
        assert prefill.num_used_blocks() == len(src_blocks)  # held for the pull until released
    finally:
        for e in (prefill, decode, colo):
            e.close()


@pytest.mark.parametrize("method", ["draft_model", "mtp"])
def test_preemption_and_seeded_replay(method: str, make_llm: Any, tiny_models: Any, mtp_model: Any) -> None:
    """A KV budget too small for every request at once: preempted requests recompute and their
    drafter state starts again (greedy tokens equal the engine's without speculation; the target
    as its own draft still has its drafts accepted); seeded sampled rows replay (the second time
    from the prefix cache)."""
    model = mtp_model if method == "mtp" else tiny_models["llama"]
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = str(model)
    kw = {"device": "cpu", "max_model_len": 160, "num_blocks_override": 12}
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[2:6]]
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    base = make_llm(model, **kw)
    llm = make_llm(model, speculative=spec, **kw)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, greedy)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want
    st = llm.engine.spec.stats
    assert llm.engine.scheduler.num_preemptions_total > 0 and st.num_drafts > 0
    if method == "draft_model":  # the target as its own draft: accepted after every restart
        assert st.num_accepted_tokens >= 0.97 * st.num_draft_tokens, st
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], sp)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:2], sp)] == first


@pytest.mark.skipif(not FULL, reason="~6 s: PDSERVE_FULL_TESTS=1 runs it; test_mtp_greedy_equal covers Llama")
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_mtp_on_qwen_families(arch: str, make_llm: Any, tiny_model_factory: Any) -> None:
    """The module's decoder layer is the target family's (q/k/v bias, q/k norms)."""
    model = tiny_model_factory(arch, mtp=True)
    want = _greedy(make_llm(model, device="cpu", max_model_len=512))
    llm = make_llm(model, device="cpu", max_model_len=512, speculative={"method": "mtp"})
    assert _greedy(llm) == want and llm.engine.spec.stats.num_drafts > 0
