"""KV-transfer messages <-> proto: handshakes, regions, pulls (decode and prefill both use them)."""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.kvtransfer.handshake import HandshakeInfo
from pdserve.kvtransfer.peer import KeepAliveReply, PullReply, PullRequest
from pdserve.kvtransfer.producer_group import PushOutcome
from pdserve.kvtransfer.regions import Region
from pdserve.rpc import node_pb2 as pb


def handshake_to_pb(h: HandshakeInfo, stages: list[pb.StageInfo] | None = None) -> pb.HandshakeInfo:
    return pb.HandshakeInfo(**h.to_dict(), stages=stages or [])


def handshake_from_pb(m: pb.HandshakeInfo) -> HandshakeInfo:
    return HandshakeInfo.from_dict(
        {
            "model_id": m.model_id,
            "dtype": m.dtype,
            "block_size": m.block_size,
            "layer_names": list(m.layer_names),
            "num_kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim,
            "layout_version": m.layout_version,
            "epoch": m.epoch,
            "kv_transport": m.kv_transport,
            "speculative": m.speculative,
            "kv_groups": m.kv_groups,
            "compat_hash": m.compat_hash,
        }
    )


def regions_to_pb(regions: Iterable[Region]) -> list[pb.Region]:
    return [pb.Region(**r.to_dict()) for r in regions]


def regions_from_pb(regions: Iterable[pb.Region]) -> list[Region]:
    """Raises ValueError for a region that cannot be one (regions.Region's checks)."""
    return [
        Region(
            r.layer_name, r.occurrence, r.base_addr, r.block_stride_bytes, r.block_bytes, r.num_blocks or None
        )
        for r in regions
    ]


def pull_request_to_pb(r: PullRequest) -> pb.PushKVRequest:
    return pb.PushKVRequest(
        transfer_id=r.transfer_id,
        dst_block_ids=list(r.dst_block_ids),
        num_tokens=r.num_tokens,
        dst_regions=regions_to_pb(r.dst_regions),
        dst_session=r.dst_session,
        dst_compat_hash=r.dst_compat_hash,
        expected_src_epoch=r.expected_src_epoch,
        want_checksum=r.want_checksum,
        dst_pp_rank=r.dst_pp_rank,
        dst_tp_rank=r.dst_tp_rank,
        dst_pp_size=r.dst_pp_size,
        dst_layer_start=r.dst_layer_start,
        dst_layer_end=r.dst_layer_end,
        dst_tp_size=r.dst_tp_size,
        early=r.early,
        dst_group_block_ids=[pb.GroupBlockIds(ids=list(t)) for t in r.dst_group_block_ids],
    )


def pull_request_from_pb(m: pb.PushKVRequest) -> PullRequest:
    """Raises ValueError for a region that cannot be one."""
    return PullRequest(
        transfer_id=m.transfer_id,
        dst_block_ids=tuple(m.dst_block_ids),
        num_tokens=m.num_tokens,
        dst_regions=tuple(regions_from_pb(m.dst_regions)),
        dst_session=m.dst_session,
        dst_compat_hash=m.dst_compat_hash,
        expected_src_epoch=m.expected_src_epoch,
        want_checksum=m.want_checksum,
        dst_pp_rank=m.dst_pp_rank,
        dst_tp_rank=m.dst_tp_rank,
        dst_pp_size=m.dst_pp_size,
        dst_layer_start=m.dst_layer_start,
        dst_layer_end=m.dst_layer_end,
        dst_tp_size=m.dst_tp_size or 1,
        early=m.early,
        dst_group_block_ids=tuple(tuple(g.ids) for g in m.dst_group_block_ids),
    )


def push_outcome_to_pb(o: PushOutcome, stage_infos: list[pb.StageInfo]) -> pb.PushKVResponse:
    """``stage_infos``: the asked prefill stages' StageInfo, in ``o.stages`` order."""
    ok, tid = o.ok, o.transfer_id
    return pb.PushKVResponse(
        ok=[tid] if ok else [],
        failed=[] if ok else [tid],
        bytes=sum(r.bytes for r in o.results) if ok else 0,
        num_descriptors=sum(r.num_descriptors for r in o.results),
        seconds=max(r.seconds for r in o.results),
        checksum=o.checksum,
        first_token_ids=o.first_token_ids,
        stages=[
            pb.StageLoad(stage=info, transfer_bytes=r.bytes, transfer_failures=0 if r.ok else 1, transfers=1)
            for info, r in zip(stage_infos, o.results, strict=True)
        ],
    )


def pull_reply_from_pb(transfer_id: str, m: pb.PushKVResponse) -> PullReply:
    return PullReply(
        ok=transfer_id in m.ok,
        bytes=int(m.bytes),
        checksum=m.checksum,
        first_token_ids=tuple(m.first_token_ids),
    )


def keep_alive_reply_from_pb(m: pb.KeepAliveResponse) -> KeepAliveReply:
    return KeepAliveReply(unknown_transfer_ids=tuple(m.unknown_transfer_ids), epoch=m.epoch)
