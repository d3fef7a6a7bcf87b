"""How large one gRPC message to a node may legitimately be: its receive limit.

gRPC buffers a whole message before the handler parses it, so the receive limit is what one
call can make a node allocate (twice: the buffer and the parsed message). A node's limit is
sized from its model instead of one cluster-wide 512 MiB:

    per request   2 x max_model_len x hidden_size x 4   prompt_embeds and image embeddings, fp32
                                                        (the widest dtype a Tensor may have), one
                                                        row per prompt position each
                + max_model_len x PER_POSITION_BYTES    token ids, item offsets and the like
                + images x max_image_bytes              a prefill node that encodes images itself:
                                                        at most max_model_len / tokens per image
    message       per request + STEP_COMMAND_BYTES      a Steps command: the router closes one once
                                                        its starts reach STEP_COMMAND_BYTES, so it
                                                        holds at most that plus one request
                + BASE_BYTES                            every other message (GetLoad, PushKV, ...)
    limit         message x MARGIN, at most MAX_MESSAGE_BYTES

The tiny test Llama (max_model_len 2,048, hidden 64) gets 11.4 MiB; hidden 4,096 gets 90 MiB
at max_model_len 2,048 and 331 MiB at 8,192; from 16,384 on the 512 MiB cap applies (and a
request with full-length fp32 prompt embeddings no longer fits in one message).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdserve.rpc.channel import MAX_MESSAGE_BYTES


class ByteSized(Protocol):
    def ByteSize(self) -> int: ...


BASE_BYTES = 4 << 20
PER_POSITION_BYTES = 64
FP32_BYTES = 4
MARGIN = 1.25
# The router's Steps writer ends a StepCommand once its starts reach this many bytes
# (services/router/step_mux.py), so one command stays within a node's limit.
STEP_COMMAND_BYTES = 4 << 20


def request_bytes(
    max_model_len: int, hidden_size: int, *, max_image_bytes: int = 0, image_tokens: int = 0
) -> int:
    """The largest request a node of this model takes (module docstring); ``max_image_bytes``
    and ``image_tokens`` only for a node that gets image bytes (0: none)."""
    assert max_model_len > 0 and hidden_size > 0
    size = 2 * max_model_len * hidden_size * FP32_BYTES + max_model_len * PER_POSITION_BYTES
    if max_image_bytes:
        size += max(1, max_model_len // max(1, image_tokens)) * max_image_bytes
    return size


def node_receive_limit_bytes(
    max_model_len: int, hidden_size: int, *, max_image_bytes: int = 0, image_tokens: int = 0
) -> int:
    """An engine node's gRPC receive limit (module docstring)."""
    per_request = request_bytes(
        max_model_len, hidden_size, max_image_bytes=max_image_bytes, image_tokens=image_tokens
    )
    return min(MAX_MESSAGE_BYTES, int((BASE_BYTES + STEP_COMMAND_BYTES + per_request) * MARGIN))


def command_split(starts: Sequence[ByteSized]) -> int:
    """How many of ``starts`` the next StepCommand takes: at least one, and more while their
    serialized sizes stay within STEP_COMMAND_BYTES."""
    size = 0
    for i, start in enumerate(starts):
        size += start.ByteSize()
        if i and size > STEP_COMMAND_BYTES:
            return i
    return len(starts)


def encoder_receive_limit_bytes(max_image_bytes: int) -> int:
    """An encoder's: one image's bytes (Encode), with the same margin."""
    return min(MAX_MESSAGE_BYTES, int((BASE_BYTES + max_image_bytes) * MARGIN))
