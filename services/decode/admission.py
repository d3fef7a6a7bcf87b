"""A DecodeRequest checked and converted for the engine (services/decode/server.py's ``Decode``
and services/decode/steps_session.py's Steps legs both admit through ``open_request``): sampling,
prompt embeddings, image items, the LoRA adapter and, for remote prefill, the handshake with its
prefill node and the request's KV record on the node's KVConsumer. A refusal is a ``Refusal``
carrying the gRPC status the caller returns."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import PdserveError
from pdserve.kvtransfer.handshake import HandshakeError
from pdserve.kvtransfer.params import RemotePrefillParams
from pdserve.kvtransfer.peer import PeerCallError
from pdserve.rpc import convert
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc.mm_convert import items_from_pb, to_engine_items
from services.lora_rpc import request_lora_refusal

if TYPE_CHECKING:
    from services.decode.server import DecodeNode


async def open_request(node: DecodeNode, request: pb.DecodeRequest) -> Admission:
    """Check a DecodeRequest and, for remote prefill, handshake with its prefill node and open
    its KV record (last: a refusal leaves nothing behind): what to admit on the engine; a
    refusal raises ``Refusal`` with the gRPC status."""
    try:
        params = convert.sampling_from_pb(request.sampling)
    except PdserveError as e:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
    if request.remote_prefill:
        if not request.transfer_id or not request.prefill_address:
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT, "remote_prefill needs transfer_id and prefill_address"
            )
        if bool(request.output_token_ids) == request.first_token_from_prefill:
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                "remote_prefill needs the first token (output_token_ids), or first_token_from_prefill "
                "without it (the pull brings it)",
            )
    embeds = None
    if request.HasField("prompt_embeds"):
        try:
            embeds = convert.tensor_from_pb(request.prompt_embeds)
        except PdserveError as e:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_embeds: {e}") from e
    mm_items: list[Any] = []
    no_recompute = False
    if request.mm_items:
        try:
            wire = items_from_pb(request.mm_items, node.opts.mm_policy)
            if not request.remote_prefill and any(it.embeds is None for it in wire):
                raise PdserveError(
                    "decode prefills this prompt itself (no remote prefill), but its image items "
                    "carry no embeddings; send them to a prefill node (EC consumer) instead"
                )
        except PdserveError as e:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        mm_items = to_engine_items(wire, [it.embeds for it in wire])
        # images' tensors not here: a failed pull cannot be recomputed on this node
        no_recompute = any(it.embeds is None for it in wire)
    assert node.engine_loop is not None
    why = request_lora_refusal(node.engine_loop.engine, request.lora_name, request.lora_ident)
    if why is not None:  # never continue KV under other adapter weights than it was made with
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, why)
    kv_params = None
    if request.remote_prefill:
        await _open_transfer(node, request, no_recompute)
        kv_params = RemotePrefillParams(request.transfer_id, request.prefill_address)
    return Admission(
        list(request.prompt_token_ids),
        params,
        request.request_id,
        dict(
            kv_transfer_params=kv_params,
            output_token_ids=list(request.output_token_ids) or None,
            prompt_embeds=embeds,
            mm_items=mm_items,
            lora_name=request.lora_name,
        ),
    )


async def _open_transfer(node: DecodeNode, request: pb.DecodeRequest, no_recompute: bool) -> None:
    """The request's KV record on the consumer (handshake with its prefill node first)."""
    addr = request.prefill_address
    try:
        await node.kv_consumer.open(
            request.request_id,
            request.transfer_id,
            addr,
            prefill_epoch=request.prefill_epoch,
            # opened with its prefill leg: the pull asks prefill to wait for the KV and brings
            # the first token; a failed one is the router's to re-drive, never recomputed here
            early=request.first_token_from_prefill,
            no_recompute=no_recompute,
        )
    except HandshakeError as e:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, f"refused at handshake: {e}") from e
    except PeerCallError as e:
        raise Refusal(
            grpc.StatusCode.FAILED_PRECONDITION if e.stale_peer else grpc.StatusCode.UNAVAILABLE,
            f"handshake with prefill {addr} failed: {e.details}",
        ) from e


class Refusal(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclasses.dataclass
class Admission:
    """What ``LLMEngine.add_request`` gets for a checked DecodeRequest."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    kwargs: dict[str, Any]
