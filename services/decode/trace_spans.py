"""A decode leg's spans (pdserve/tracing.py), made when the leg ends from the times noted on the
way: the engine thread only appends a time.monotonic() reading to a list."""

from __future__ import annotations

import time
from typing import Any

from pdserve import tracing
from pdserve.rpc import node_pb2 as pb


def trace_decode(
    node: Any, request: pb.DecodeRequest, times: list[float], pull: list[float], finished: bool
) -> None:
    """``times``: [admitted, first delta]; ``pull``: [pull start, pull end, bytes] (remote prefill)::

    decode            admitted -> end              (child of the router's decode leg)
      decode.queue    admitted -> pull start       (blocks allocated, the pull handed over)
      kv_transfer     pull start -> pull end       (pdserve.kv_bytes, pdserve.kv_seconds)
      decode.first_token  admitted -> first delta
      decode.stream   first delta -> end
    """
    end = time.monotonic()
    span = tracing.record(
        "decode",
        tracing.context_of(request.traceparent),
        times[0],
        end,
        **{"pdserve.node": node.opts.name, "pdserve.remote_prefill": request.remote_prefill},
        **{"pdserve.prompt_tokens": len(request.prompt_token_ids), "pdserve.finished": finished},
    )
    if len(pull) == 3:
        tracing.record("decode.queue", span, times[0], pull[0])
        tracing.record(
            "kv_transfer",
            span,
            pull[0],
            pull[1],
            **{
                "pdserve.prefill_address": request.prefill_address,
                "pdserve.transfer_id": request.transfer_id,
                "pdserve.kv_bytes": int(pull[2]),
                "pdserve.kv_seconds": pull[1] - pull[0],
            },
        )
    if len(times) == 2:
        tracing.record("decode.first_token", span, times[0], times[1])
        tracing.record("decode.stream", span, times[1], end)
