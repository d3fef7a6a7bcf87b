"""The protobuf messages the router's legs send to the nodes (proto/pdserve/rpc/node.proto).

``prefill_request`` is the prefill leg's ``PrefillRequest`` (services/router/pd_prefill_leg.py);
``decode_request`` the decode leg's ``DecodeRequest``, fresh or opened early with the prefill leg
(services/router/pd_decode_leg.py). Both carry the request's prompt embeddings and image items,
with tensors only to the node that computes the prompt: decode never receives images.
"""

from __future__ import annotations

import dataclasses

from pdserve.kvtransfer.topology import need_send
from pdserve.rpc import convert
from pdserve.rpc import node_pb2 as pb
from services.router.backend import BackendRequest
from services.router.nodes import NodeHandle, RouterPolicy


def prefill_request(
    req: BackendRequest, transfer_id: str, p: NodeHandle, d_pp: int, d_tp: int
) -> pb.PrefillRequest:
    """P.Prefill's request: the prompt, the KV held under ``transfer_id`` for ``need_send`` pulls
    (decode's ``d_pp`` stages and ``d_tp`` ranks against ``p``'s)."""
    return pb.PrefillRequest(
        transfer_id=transfer_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling=convert.sampling_to_pb(req.sampling_params),
        # pulls each prefill stage / TP rank waits for
        need_send=need_send(p.tp_size, p.pp_size, d_tp, d_pp),
        prompt_embeds=_embeds_pb(req),
        mm_items=_mm_items_pb(req, with_tensors=True),
        lora_name=req.lora_name,
    )


def decode_request(
    req: BackendRequest,
    policy: RouterPolicy,
    transfer_id: str | None,
    p_node: NodeHandle | None,
    first_tokens: list[int],
    early: bool = False,
    traceparent: str = "",
) -> pb.DecodeRequest:
    """The decode leg's request: local (``transfer_id`` None: decode prefills the prompt) or a
    pull of the KV ``p_node`` holds under ``transfer_id`` (the Prefill answer's epoch for it is
    taken from ``p_node.epoch_by_transfer``). ``early``: opened with the prefill leg, the pull
    brings the first token."""
    params = req.sampling_params
    if transfer_id is not None and params.prompt_logprobs is not None:
        # Prefill returned them with the first token; decode does not compute the prompt.
        params = dataclasses.replace(params, prompt_logprobs=None)
    return pb.DecodeRequest(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling=convert.sampling_to_pb(params),
        output_token_ids=first_tokens,
        remote_prefill=transfer_id is not None,
        transfer_id=transfer_id or "",
        prefill_address=p_node.address if p_node else "",
        prefill_epoch=p_node.epoch_by_transfer.pop(transfer_id, "") if p_node and transfer_id else "",
        # Decode needs the embeddings only if it prefills (local path, or recompute after a
        # failed pull); sent always so the recompute policy stays correct.
        prompt_embeds=_embeds_pb(req),
        # Keys only when prefill computed the prompt (the KV holds the images); tensors only
        # when decode prefills it itself (precomputed image_embeds on a cluster without P).
        mm_items=_mm_items_pb(req, with_tensors=transfer_id is None),
        # Tokens nobody reads before the end travel in a few messages, not one per step;
        # streamed ones too when router.stream_flush_ms asks for it.
        flush_interval_ms=policy.stream_flush_ms if req.streamed else policy.nonstream_flush_ms,
        first_token_from_prefill=early,
        lora_name=req.lora_name,
        # KV pulled from prefill: decode must hold the content prefill used (pd_flow opens no
        # early leg for an adapter request, so prefill has answered by now)
        lora_ident=req.lora_ident if transfer_id is not None else "",
        traceparent=traceparent,
    )


def _embeds_pb(req: BackendRequest) -> pb.Tensor | None:
    return convert.tensor_to_pb(req.prompt_embeds) if req.prompt_embeds is not None else None


def _mm_items_pb(req: BackendRequest, *, with_tensors: bool) -> list[pb.MmItem]:
    return [
        pb.MmItem(
            offset=it.offset,
            length=it.length,
            key=it.key,
            embeds=convert.tensor_to_pb(it.embeds) if with_tensors and it.embeds is not None else None,
            encoder_address=it.encoder_address,
            image=it.image if with_tensors and it.image is not None else b"",  # never to decode
        )
        for it in req.mm_items
    ]
