"""Token logprobs in OpenAI's two shapes: legacy completions and chat.

``TokenLogprob`` carries ids only; the text of a token is ``tokenizer.decode([id])``, cached. A
token that is part of a multi-byte character decodes to U+FFFD on its own, as in vLLM.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pdserve.engine.outputs import TokenLogprob


class TokenTexts:
    def __init__(self, tokenizer: Any) -> None:
        self._decode = lru_cache(maxsize=65536)(lambda tid: tokenizer.decode([tid]))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)


def completion_logprobs(
    texts: TokenTexts, lps: list[TokenLogprob], text_offset: int
) -> tuple[dict[str, Any], int]:
    """Legacy shape for one run of tokens; returns it and the text offset after the run.

    ``text_offset`` counts characters from the start of the choice's text (no echo).
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for lp in lps:
        tok = texts(lp.token_id)
        tokens.append(tok)
        token_logprobs.append(lp.logprob)
        # A dict keyed by token text: alternatives that decode alike keep the best logprob.
        top: dict[str, float] = {}
        for tid, logprob in lp.top:
            top.setdefault(texts(tid), logprob)
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(tok)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
    return body, text_offset


def echo_logprobs(
    texts: TokenTexts, prompt_token_ids: list[int], prompt_lps: list[TokenLogprob] | None
) -> tuple[dict[str, Any], int]:
    """The legacy shape for an echoed prompt: the first token has no logprob (``null``); the
    others come from the prefilling node (``None`` when it sent none: every value null).
    Returns it and the text offset after the prompt; completion tokens continue from there."""
    first = prompt_token_ids[:1]
    tokens = [texts(t) for t in first]
    body: dict[str, Any] = {
        "tokens": tokens,
        "token_logprobs": [None] * len(first),
        "top_logprobs": [None] * len(first),
        "text_offset": [0] * len(first),
    }
    offset = sum(len(t) for t in tokens)
    if prompt_lps is None:
        rest = prompt_token_ids[1:]
        for tid in rest:
            tok = texts(tid)
            body["tokens"].append(tok)
            body["token_logprobs"].append(None)
            body["top_logprobs"].append(None)
            body["text_offset"].append(offset)
            offset += len(tok)
        return body, offset
    more, offset = completion_logprobs(texts, prompt_lps, offset)
    return merge_logprobs(body, more), offset


def merge_logprobs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two runs of the legacy shape, one after the other."""
    return {k: a[k] + b[k] for k in a}


def _chat_entry(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    tok = texts(token_id)
    return {"token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8"))}


def chat_logprobs(texts: TokenTexts, lps: list[TokenLogprob], num_top: int) -> dict[str, Any]:
    content = []
    for lp in lps:
        entry = _chat_entry(texts, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_chat_entry(texts, tid, logprob) for tid, logprob in lp.top[:num_top]]
        content.append(entry)
    return {"content": content}
