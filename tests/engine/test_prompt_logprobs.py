"""Prompt logprobs equal transformers' log-softmax of the prompt (fp32), across chunked prefill,
with a warm prefix cache (the request must not take the hit), and under asynchronous scheduling."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError


def reference_prompt_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: log_softmax of transformers' logits at positions 0 .. P - 2."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(dim=-1)[:-1]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_equal_transformers(tiny_models, make_llm, async_scheduling) -> None:
    model_dir = tiny_models["llama"]
    # 16-token budget: a 70-token prompt prefills in 5 chunks; 16-token blocks make prefix hits.
    # float32 also on CUDA (where auto is bf16): the check is to 1e-4
    llm = make_llm(
        model_dir,
        max_num_batched_tokens=16,
        block_size=16,
        async_scheduling=async_scheduling,
        dtype="float32",
    )
    ids = [(7 * i + 3) % 500 + 1 for i in range(70)]
    warm = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert warm.prompt_logprobs is None
    again = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert again.num_cached_tokens >= 48  # the cache is warm ...
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3))[0]
    assert out.num_cached_tokens == 0  # ... yet this request computed every position
    ref = reference_prompt_logprobs(model_dir, ids)
    # vLLM's shape: None for the first token, then {token_id: Logprob}, the prompt's token first.
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(ids) and lps[0] is None
    got = torch.tensor([lp[t].logprob for lp, t in zip(lps[1:], ids[1:], strict=True)])
    want = ref.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    top_v, top_i = ref.topk(3, dim=-1)
    for j, lp in enumerate(lps[1:]):
        assert lp is not None and next(iter(lp)) == ids[j + 1]
        top = sorted((x.rank, t, x.logprob) for t, x in lp.items() if x.rank is not None)
        assert [t for _, t, _ in top] == top_i[j].tolist() and [r for r, _, _ in top] == [1, 2, 3]
        torch.testing.assert_close(torch.tensor([v for _, _, v in top]), top_v[j], atol=1e-4, rtol=0)
    assert out.outputs[0].token_ids == warm.outputs[0].token_ids  # sampling is unaffected


def test_prompt_logprobs_mixed_batch_and_zero_top(tiny_models, make_llm) -> None:
    model_dir = tiny_models["qwen2"]
    llm = make_llm(model_dir, max_num_batched_tokens=24, dtype="float32")
    a = [5, 9, 33, 2, 41, 8, 17, 250, 3, 3, 77]
    b = [100 + i for i in range(30)]
    outs = llm.generate(
        [a, b, [42]],
        [
            SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0),
            SamplingParams(temperature=0.0, max_tokens=3),
            SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2),
        ],
    )
    assert outs[1].prompt_logprobs is None
    assert outs[2].prompt_logprobs == [None]  # a one-token prompt has no scored token
    lps = outs[0].prompt_logprobs
    assert lps is not None and lps[0] is None
    assert [list(lp or {}) for lp in lps[1:]] == [[t] for t in a[1:]]  # top 0: the prompt token only
    want = reference_prompt_logprobs(model_dir, a).gather(1, torch.tensor(a[1:])[:, None]).squeeze(1)
    got = torch.tensor([lp[t].logprob for lp, t in zip(lps[1:], a[1:], strict=True) if lp is not None])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_prompt_logprobs_refused_with_prompt_embeds(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models["llama"])
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        llm.engine.add_request(
            [1], SamplingParams(prompt_logprobs=1), prompt_embeds=torch.zeros(3, llm.engine.arch.hidden_size)
        )
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
