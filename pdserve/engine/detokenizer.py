"""Incremental detokenization and stop strings (host-side, no torch).

Byte-level BPE can split one character over several tokens; text is only emitted once it no
longer ends in U+FFFD (an incomplete UTF-8 sequence). Only a short window of tokens is
decoded per step (the prefix/read offsets), so cost per token stays flat.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

INITIAL_WINDOW = 5


@dataclass
class DetokState:
    stop: list[str]
    include_stop: bool
    skip_special: bool
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""
    emitted: int = 0  # chars of ``text`` already handed out
    stopped_by: str | None = None
    token_ids: list[int] = field(default_factory=list)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # The Rust tokenizer decodes far faster than the Python wrapper.
        self._fast = getattr(tokenizer, "_tokenizer", None) or getattr(tokenizer, "backend_tokenizer", None)
        self.max_stop_len = 0

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=skip_special)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def new_state(self, stop: list[str], include_stop: bool, skip_special: bool) -> DetokState:
        return DetokState(stop=list(stop), include_stop=include_stop, skip_special=skip_special)

    def append(self, st: DetokState, new_ids: list[int]) -> str:
        """Add tokens; returns newly emittable text (stop strings cut). Sets ``st.stopped_by``."""
        ids = st.token_ids
        ids.extend(new_ids)
        prefix = self._decode(ids[st.prefix_offset : st.read_offset], st.skip_special)
        full = self._decode(ids[st.prefix_offset :], st.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            st.text += full[len(prefix) :]
            st.prefix_offset = st.read_offset
            st.read_offset = len(ids)
        if st.stop and st.stopped_by is None:
            self._check_stop(st)
        # Hold back a tail that could still become a stop string.
        limit = len(st.text)
        if st.stop and st.stopped_by is None:
            limit = max(st.emitted, len(st.text) - (max(len(s) for s in st.stop) - 1))
        out = st.text[st.emitted : limit]
        st.emitted = limit
        return out

    def flush(self, st: DetokState) -> str:
        """The request finished: hand out whatever was held back, an incomplete character too
        (as U+FFFD, like a full decode of the output would show it)."""
        if st.stopped_by is None and st.read_offset < len(st.token_ids):
            prefix = self._decode(st.token_ids[st.prefix_offset : st.read_offset], st.skip_special)
            full = self._decode(st.token_ids[st.prefix_offset :], st.skip_special)
            if len(full) > len(prefix):
                st.text += full[len(prefix) :]
            st.prefix_offset = st.read_offset = len(st.token_ids)
        out = st.text[st.emitted :]
        st.emitted = len(st.text)
        return out

    @staticmethod
    def _check_stop(st: DetokState) -> None:
        longest = max(len(s) for s in st.stop)
        # Only the new text (plus a stop string's length before it) can hold a new match.
        start = max(0, st.emitted - longest)
        best: tuple[int, str] | None = None
        for s in st.stop:
            i = st.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            st.text = st.text[: i + len(s)] if st.include_stop else st.text[:i]
            st.stopped_by = s
