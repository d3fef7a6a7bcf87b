"""Decode and check ``prompt_embeds``: base64 of a safetensors file holding one tensor.

Parsed with ``safetensors.torch.load`` (a JSON header plus raw bytes): never unpickled. Every
check names the bad value and what is allowed, and fails with a 400 before anything reaches a
node.
"""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING

from services.router.errors import bad_request

if TYPE_CHECKING:
    import torch

# torch is imported on the first request that carries prompt_embeds: a router that never sees one
# starts without it (~1.5 s of CPU per router process on the 2-core VM)
ALLOWED_DTYPES = ("float32", "bfloat16", "float16")
# Room for the safetensors JSON header on top of the tensor bytes.
_HEADER_SLACK_BYTES = 64 * 1024


def max_prompt_embeds_bytes(max_model_len: int, hidden_size: int) -> int:
    """The largest decoded file we accept: a float32 tensor of max_model_len rows, plus header."""
    return max_model_len * hidden_size * 4 + _HEADER_SLACK_BYTES


def decode_prompt_embeds(
    encoded: str, *, hidden_size: int | None, max_bytes: int, param: str
) -> torch.Tensor:
    """Return the checked tensor, ``[num_tokens, hidden_size]`` in its sent dtype."""
    if hidden_size is None:
        raise bad_request("prompt_embeds is not enabled on this server (no hidden size configured)", param)
    # base64 is 4/3 the size of what it encodes: refuse oversized bodies before decoding them.
    if len(encoded) > (max_bytes * 4) // 3 + 4:
        raise bad_request(f"prompt_embeds is larger than the limit of {max_bytes} bytes decoded", param)
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad_request(f"prompt_embeds is not valid base64: {e}", param) from e
    try:
        tensors = load_safetensors(raw)
    except SafetensorError as e:
        raise bad_request(f"prompt_embeds is not a valid safetensors file: {e}", param) from e
    if len(tensors) != 1:
        raise bad_request(f"prompt_embeds must hold exactly one tensor, got {len(tensors)}", param)
    (embeds,) = tensors.values()
    if str(embeds.dtype).removeprefix("torch.") not in ALLOWED_DTYPES:
        allowed = ", ".join(ALLOWED_DTYPES)
        raise bad_request(
            f"prompt_embeds dtype {str(embeds.dtype).removeprefix('torch.')} is not allowed; use one of {allowed}",
            param,
        )
    if embeds.dim() != 2 or embeds.shape[1] != hidden_size:
        raise bad_request(
            f"prompt_embeds must have shape [num_tokens, {hidden_size}], got {list(embeds.shape)}", param
        )
    if embeds.shape[0] == 0:
        raise bad_request("prompt_embeds has no rows: the prompt is empty", param)
    if not bool(torch.isfinite(embeds).all()):
        raise bad_request("prompt_embeds contains NaN or infinite values", param)
    return embeds
