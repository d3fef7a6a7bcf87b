"""Token logprobs in OpenAI's two shapes: legacy completions and chat.

``TokenLogprob`` carries ids only; the router turns an id into its text and its bytes here,
cached. A token's bytes are its own: for a byte-level BPE tokenizer the piece mapped back through
the byte alphabet, for a ``<0xHH>`` byte-fallback piece that byte, else its decoded text. A token
whose bytes are not valid UTF-8 on their own (half of a multi-byte character) is shown as
``bytes:\\xHH..`` in ``token``, as OpenAI does, instead of U+FFFD; ``bytes`` are the real ones, so
a client joining the ``bytes`` of consecutive tokens gets the text back.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from pdserve.engine.outputs import TokenLogprob

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): printable bytes stand for themselves, the other
    bytes for code points from 256 on, in byte order. Maps each character back to its byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in table.items()}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and type(decoder).__name__ == "ByteLevel"


class TokenTexts:
    """token id -> (text shown in ``token``, its bytes)."""

    def __init__(self, tokenizer: Any) -> None:
        alphabet = _byte_level_alphabet() if _is_byte_level(tokenizer) else None
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())

        def info(tid: int) -> tuple[str, bytes]:
            text = tokenizer.decode([tid])
            raw = text.encode("utf-8")
            piece = tokenizer.convert_ids_to_tokens(tid) if tid not in special else None
            if isinstance(piece, str) and piece:
                m = _BYTE_FALLBACK.match(piece)
                if m:
                    raw = bytes([int(m.group(1), 16)])
                elif alphabet is not None and all(c in alphabet for c in piece):
                    raw = bytes(alphabet[c] for c in piece)
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw
            return text, raw

        self._info = lru_cache(maxsize=65536)(info)

    def __call__(self, token_id: int) -> str:
        return self._info(token_id)[0]

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self._info(token_id)[1])


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
    return {"token": texts(token_id), "logprob": logprob, "bytes": texts.token_bytes(token_id)}


def chat_logprobs(texts: TokenTexts, lps: list[TokenLogprob], num_top: int) -> dict[str, Any]:
    content = []
    for lp in lps:
        entry = _chat_entry(texts, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_chat_entry(texts, tid, logprob) for tid, logprob in lp.top[:num_top]]
        content.append(entry)
    return {"content": content}
