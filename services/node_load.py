"""What an engine node's ``GetLoad`` answers: its ``LoadReport`` (queue lengths, KV blocks, the
Steps socket's address, LoRA identities) with one ``StageLoad`` per pipeline stage / TP rank,
and UNAVAILABLE while the node is starting or once its engine died. ``NodeBase``'s methods of
the same names (services/node.py) call these; the role hooks they read (held and stranded
blocks, a stage's transfer counters) are the node's own, so a role's overrides count."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc

from pdserve.distributed.pp_stage import StageEndpoint
from pdserve.errors import EngineDeadError

if TYPE_CHECKING:
    from services.node import NodeBase


async def answer_load(node: NodeBase, pb: Any, context: grpc.aio.ServicerContext) -> Any:
    """GetLoad: the report; UNAVAILABLE while the node is starting (its readiness is not
    SERVING yet: the report carries the Steps socket's address only once it listens) and
    once the engine died (the router drops the node)."""
    if not node.started:
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"node {node.opts.name} is starting")
    try:
        return node.load_report(pb)
    except EngineDeadError as e:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))


def load_report(node: NodeBase, pb: Any) -> Any:
    if node.engine_loop is not None:
        node.engine_loop.check_alive()  # a dead engine's counters are frozen: no report
    eng = node.engine
    st = eng.scheduler.stats()
    return pb.LoadReport(
        node=node.opts.name,
        role=node.opts.role,
        epoch=node.epoch,
        num_running=st.num_running,
        num_waiting=st.num_waiting + st.num_waiting_for_remote_kv,
        num_blocks_total=eng.kv.pool.num_blocks,
        num_blocks_used=eng.kv.pool.num_used_blocks,
        num_blocks_held_for_transfer=node.held_transfer_blocks(),
        num_held_requests=eng.kv.num_held_requests,
        stranded_kv_blocks=node.stranded_kv_blocks(),
        num_aborted_total=eng.num_aborted_total + node.aborted_holds_total(),
        block_size=eng.kv.block_size,
        stages=node.stage_loads(pb),
        num_ec_reservations=node.ec_reservations(),
        steps_socket=node.steps_socket,
        prefix_cache_queried_blocks=eng.kv.pool.num_queried_blocks,
        prefix_cache_hit_blocks=eng.kv.pool.num_hit_blocks,
        lora_idents=eng.lora.published_idents if eng.lora is not None else {},
    )


def stage_info(pb: Any, st: StageEndpoint) -> Any:
    return pb.StageInfo(
        pp_rank=st.pp_rank,
        tp_rank=st.tp_rank,
        tp_size=st.tp_size,
        pp_size=st.pp_size,
        layer_start=st.layer_start,
        layer_end=st.layer_end,
        session=st.session,
    )


def stage_loads(node: NodeBase, pb: Any) -> list[Any]:
    used = node.engine.kv.pool.num_used_blocks
    held, stranded = node.held_transfer_blocks(), node.stranded_kv_blocks()
    out = []
    for i, st in enumerate(node.stages):
        nbytes, failures, transfers = node.stage_transfer_counters(i)
        out.append(
            pb.StageLoad(
                stage=node.stage_info(pb, st),
                blocks_used=used,
                blocks_held_for_transfer=held,
                stranded_kv_blocks=stranded,
                transfer_bytes=nbytes,
                transfer_failures=failures,
                transfers=transfers,
            )
        )
    return out
