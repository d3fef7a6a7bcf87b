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
