"""pdserve/rpc/kv_convert.py: a pull survives the proto both ways, field by field, and a push's
outcome becomes the PushKVResponse decode reads back."""

from __future__ import annotations

import dataclasses

from pdserve.kvtransfer.connector import PushResult
from pdserve.kvtransfer.peer import PullReply, PullRequest
from pdserve.kvtransfer.producer_group import PushOutcome
from pdserve.kvtransfer.regions import Region
from pdserve.rpc import kv_convert
from pdserve.rpc import node_pb2 as pb


def test_a_pull_request_round_trips_every_field() -> None:
    req = PullRequest(
        transfer_id="t",
        dst_block_ids=(4, 9),
        num_tokens=20,
        dst_regions=(Region("model.layers.0.self_attn", 0, 4096, 1024, 512, 8), Region("x", 1, 0, 64, 64)),
        dst_session="127.0.0.1:9000",
        dst_compat_hash="h",
        expected_src_epoch="e",
        want_checksum=True,
        dst_pp_rank=1,
        dst_tp_rank=0,
        dst_pp_size=2,
        dst_layer_start=8,
        dst_layer_end=16,
        early=True,
    )
    m = kv_convert.pull_request_to_pb(req)
    back = kv_convert.pull_request_from_pb(pb.PushKVRequest.FromString(m.SerializeToString()))
    assert back == req
    # every field of the dataclass has its proto twin (a new one must be converted too)
    assert {f.name for f in dataclasses.fields(PullRequest)} <= {
        f.name for f in pb.PushKVRequest.DESCRIPTOR.fields
    }


def test_a_push_outcome_reads_back_as_decode_sees_it() -> None:
    results = [PushResult(True, 100, 2, 0.5), PushResult(True, 50, 1, 0.25)]
    out = PushOutcome("t", [0, 1], results, "abc", [7])
    m = kv_convert.push_outcome_to_pb(out, [pb.StageInfo(pp_rank=0), pb.StageInfo(pp_rank=1)])
    assert (m.bytes, m.num_descriptors, m.seconds, [s.transfer_bytes for s in m.stages]) == (
        150,
        3,
        0.5,
        [100, 50],
    )
    assert kv_convert.pull_reply_from_pb("t", m) == PullReply(True, 150, "abc", (7,))
    failed = dataclasses.replace(out, results=[PushResult(False, 0, 2, 0.1, "boom"), results[1]])
    m = kv_convert.push_outcome_to_pb(failed, [pb.StageInfo(), pb.StageInfo()])
    assert list(m.failed) == ["t"] and m.bytes == 0 and not kv_convert.pull_reply_from_pb("t", m).ok
