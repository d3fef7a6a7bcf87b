"""A node's KV transfer set-up: the KV settings it refuses at start, then its transfer engine
over the engine's KV caches, the handshake peers compare and one endpoint per pipeline stage or
TP rank. ``NodeBase.__init__`` (services/node.py) calls both; prefill and decode build their
producers and consumer on what :func:`open_node_kv` returns."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config.node_spec import NodeSpec
from pdserve.distributed.pp_stage import KVWorkers, PipelineRunner, StageEndpoint
from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import ConfigError
from pdserve.kvtransfer.backend import TransferBackend
from pdserve.kvtransfer.exposure import check_kv_ports, check_no_wildcard
from pdserve.kvtransfer.factory import make_backend
from pdserve.kvtransfer.group_transfer import kv_groups_wire, kv_tensors_of
from pdserve.kvtransfer.handshake import HandshakeInfo
from pdserve.kvtransfer.regions import Region
from pdserve.kvtransfer.runner_kv import drafter_kv_buffers, handshake_info_of, kv_regions_of
from pdserve.kvtransfer.speculative_compat import spec_wire


def check_kv_settings(opts: NodeSpec) -> None:
    """Refuse, before the engine is built, the KV settings this node cannot act on: Mooncake's
    ports where they would be exposed (kvtransfer/exposure.py), and a non-Mooncake transport or
    ``kv_checksum`` on a node with several stages or TP ranks. Raises ConfigError."""
    if opts.role.moves_kv:
        check_kv_ports(
            opts.name, opts.kv_transport, opts.host, opts.kv_host, opts.allow_unauthenticated_kv_ports
        )
    pp = opts.engine.parallel.pipeline_parallel_size
    tp = opts.engine.parallel.tensor_parallel_size
    if (pp > 1 or tp > 1) and opts.role.moves_kv:
        # Every stage / TP rank process opens its own endpoint (KVWorkers.start_kv_endpoints);
        # only the Mooncake transports are wired and tested for that.
        if not opts.kv_transport.is_mooncake:
            raise ConfigError(
                f"kv_transport '{opts.kv_transport}' with pp={pp}, tp={tp} on a {opts.role} node "
                "is not supported; use kv_transport 'tcp' or 'rdma' (or pp: 1 and tp: 1)"
            )
        if opts.kv_checksum:
            raise ConfigError(
                f"kv_checksum with pp={pp}, tp={tp} on a {opts.role} node is not supported (the "
                "digest covers one stage's and rank's KV); set kv_checksum: false or pp: 1, tp: 1"
            )


@dataclass
class NodeKV:
    """What :func:`open_node_kv` sets up; ``NodeBase`` keeps each as an attribute of its own."""

    backend: TransferBackend | None  # the node process's transfer engine (None: its role moves no KV)
    regions: list[Region]  # stage 0's layers
    handshake: HandshakeInfo
    stages: list[StageEndpoint]


def open_node_kv(opts: NodeSpec, engine: LLMEngine, epoch: str) -> NodeKV:
    """The transfer engine with the engine's KV caches registered (roles that move KV), the
    handshake, and the node's KV endpoints (workers of stages / ranks 1.. open theirs now)."""
    backend: TransferBackend | None = None
    runner = engine.runner
    if opts.role.moves_kv:
        backend = make_backend(opts.kv_transport, opts.kv_host, str(runner.device))
        check_no_wildcard(
            opts.name, opts.kv_transport, opts.host, opts.allow_unauthenticated_kv_ports, backend
        )
        for cache in kv_tensors_of(runner):  # each KV group's tensor, or the one
            assert cache is not None
            backend.register(cache.data_ptr(), cache.numel() * cache.element_size())
        for addr, nbytes in drafter_kv_buffers(runner):  # an MTP module's KV moves too
            backend.register(addr, nbytes)
    regions = kv_regions_of(runner)  # stage 0's layers
    kv = engine.kv
    handshake = handshake_info_of(
        runner,
        opts.engine.model,
        epoch,
        opts.kv_transport,
        spec_wire(opts.engine.speculative),
        kv_groups_wire([m.spec for m in kv.coordinator.managers], kv.groups is not None),
    )
    # The node's KV endpoints, one per pipeline stage or TP rank (one when pp = tp = 1): each
    # its layers, KV heads, session, regions.
    tp = opts.engine.parallel.tensor_parallel_size
    ranges = runner.ranges if isinstance(runner, PipelineRunner) else [(0, engine.arch.num_hidden_layers)]
    session = backend.session_id if backend is not None else ""
    stages: list[StageEndpoint] = [
        StageEndpoint(0, len(ranges), ranges[0][0], ranges[0][1], session, tuple(regions), tp_size=tp)
    ]
    if isinstance(runner, KVWorkers) and backend is not None:
        stages += runner.start_kv_endpoints(opts.kv_transport, opts.kv_host)
    elif isinstance(runner, PipelineRunner):
        stages += [StageEndpoint(i, len(ranges), lo, hi, "", ()) for i, (lo, hi) in enumerate(ranges)][1:]
    return NodeKV(backend, regions, handshake, stages)
