"""What every engine node (prefill, decode, colocated) shares: ``NodeBase``, its engine and its
serve() (the gRPC server with health checking, metrics, a clean shutdown). Its parts live beside
it: KV transfer set-up (node_kv.py), the Steps socket (node_frontend.py), GetLoad (node_load.py),
watchdogs (engine_watchdog.py, stage_watchdog.py), node_lifecycle.py, node_metrics.py, node_faults.py."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from pdserve import tracing
from pdserve.config.node_spec import NodeSpec
from pdserve.distributed.pp_stage import KVWorkers, StageEndpoint
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.kvevents.publisher import KVEventPublisher, start_publisher
from pdserve.kvtransfer.backend import TransferBackend
from pdserve.kvtransfer.group_transfer import shared_table_reason
from pdserve.kvtransfer.handshake import new_epoch
from pdserve.pcp.runner import PCPModelRunner
from pdserve.rpc.limits import node_receive_limit_bytes
from pdserve.rpc.malformed import MalformedRequestInterceptor
from services import node_faults, node_load
from services.engine_watchdog import EngineWatchdog
from services.memwatch import start_memwatch
from services.node_frontend import check_frontend_port, start_steps_front
from services.node_kv import check_kv_settings, open_node_kv
from services.node_lifecycle import DrainGate, drain, start_grpc_server, start_membership
from services.node_metrics import NodeCollector
from services.stage_watchdog import StageWatchdog
from services.steps_socket import StepsFront

logger = logging.getLogger(__name__)
EXIT_ENGINE_DIED = 70  # EX_SOFTWARE: the process exits with it after its engine thread died
ENGINE_DEATH_LINGER_S = 1.0  # NOT_SERVING is visible this long before the process exits


class NodeBase:
    """Engine + transfer engine + gRPC server. Subclasses add their servicer."""

    def __init__(self, opts: NodeSpec) -> None:
        self.opts = opts
        self.epoch = new_epoch()
        check_kv_settings(opts)
        check_frontend_port(opts)
        kv_transfer = opts.role.moves_kv
        self.engine = LLMEngine(
            opts.engine,
            on_hold_for_transfer=self._on_hold if kv_transfer else None,
            shared_kv_table_reason=shared_table_reason(kv_transfer, opts.kv_checksum, opts.kv_transport),
        )
        kv = open_node_kv(opts, self.engine, self.epoch)
        self.backend: TransferBackend | None = kv.backend
        self.regions = kv.regions  # stage 0's layers
        self.handshake = kv.handshake
        # The node's KV endpoints, one per pipeline stage or TP rank (one when pp = tp = 1).
        self.stages: list[StageEndpoint] = kv.stages
        self.exit_code = 0  # non-zero: the node stopped because a part of it failed
        self.loop: asyncio.AbstractEventLoop | None = None
        self._drain_on_stop = False  # SIGTERM / SIGINT drain; request_stop() stops at once
        self.engine_loop: EngineLoop | None = None
        self.drain_gate: DrainGate | None = None  # set by serve(); Steps admits through it too
        self.registry = CollectorRegistry()
        self.registry.register(NodeCollector(self))
        # Decode / colocated: set once the Steps socket listens (LoadReport.steps_socket).
        self.steps_socket = ""
        self.frontend: StepsFront | None = None
        self.kv_events: KVEventPublisher | None = None  # serve() starts it when redis_url is set
        # Set with readiness (health SERVING): until then GetLoad answers UNAVAILABLE, so a router
        # polling a starting node never takes it before its Steps socket is known.
        self.started = False
        self.engine_watchdog: EngineWatchdog | None = (
            None  # set by serve(): step_timeout_s on the engine thread
        )

    # hooks -------------------------------------------------------------------------------------
    def _on_hold(self, req: Any, block_ids: list[int]) -> bool:
        return False

    def _on_step(self, engine: LLMEngine) -> None:
        pass

    def _on_kv_loads(self, loads: list[Any]) -> None:
        pass

    def add_servicers(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    def stranded_kv_blocks(self) -> int:
        return 0

    def held_transfer_blocks(self) -> int:
        return 0

    def transfer_counters(self) -> list[tuple[str, str, float]]:
        return []

    def request_state_sizes(self) -> dict[str, int]:
        """Entries in the node's per-request maps (0 each once no request is in flight: one
        left behind is a leak; ``pdserve:request_state_entries``). Roles add theirs."""
        eng, sched = self.engine, self.engine.scheduler
        out = {
            "scheduler.requests": len(sched.requests),
            "scheduler.waiting_for_kv": len(sched.waiting_for_kv),
            "scheduler.waiting_for_grammar": len(sched.waiting_for_grammar),
            "scheduler.held_for_transfer": len(sched.held_for_transfer),
            "output_processor.tracked": len(eng.output_processor.tracked),
            "kv_cache_manager.requests": eng.kv.num_held_requests,
        }
        if isinstance(eng.runner, ModelRunner):
            out["model_runner.generators"] = eng.runner.num_generators
        if self.engine_loop is not None:
            out["engine_loop.streams"] = self.engine_loop.num_streams
        return out

    def receive_limit_bytes(self) -> int:
        """The largest gRPC message this node takes (pdserve/rpc/limits.py)."""
        images = self.opts.image_limits if self.opts.colocated_encoder else None
        model = getattr(self.engine.runner, "model", None)
        return node_receive_limit_bytes(
            self.engine.max_model_len,
            self.engine.arch.hidden_size,
            max_image_bytes=images.max_image_bytes if images is not None else 0,
            image_tokens=int(getattr(model, "num_image_tokens", 0) or 0),
        )

    def ec_reservations(self) -> int:
        """EC consumers: embedding-buffer reservations alive now (0 between requests)."""
        return 0

    def aborted_holds_total(self) -> int:
        """Prefill: KV holds released by an abort (their request had already finished here)."""
        return 0

    def stage_transfer_counters(self, index: int) -> tuple[int, int, int]:
        """(bytes, failures, transfers) of endpoint ``self.stages[index]``."""
        return (0, 0, 0)

    def stage_info(self, pb: Any, st: StageEndpoint) -> Any:
        return node_load.stage_info(pb, st)

    def stage_loads(self, pb: Any) -> list[Any]:
        return node_load.stage_loads(self, pb)

    # lifecycle -----------------------------------------------------------------------------------
    async def serve(self, ready: asyncio.Event | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        tracing.init_tracing(f"pdserve-{self.opts.role}")  # OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set
        kv = self.engine.kv
        if self.opts.redis_url and kv.enable_prefix_caching:  # KV events for the router's prefix index
            self.kv_events = start_publisher(
                kv.pool,
                self.opts.redis_url,
                self.opts.name,
                self.epoch,
                kv.block_size,
                self.opts.cluster.kv_events,
                kv.offload,
            )
        self.engine_loop = EngineLoop(
            self.engine, self.loop, self._on_kv_loads, self._on_step, on_death=self._on_engine_death
        )
        self.engine_loop.start()
        gate = self.drain_gate = DrainGate()
        server = frontend = None
        try:
            # token first (an unauthenticated call learns nothing), then the drain gate, then the
            # malformed-request guard innermost (it wraps the deserializers the gate re-wraps)
            server, health_servicer, addr = await start_grpc_server(
                self.opts.host,
                self.opts.grpc_port,
                [gate, MalformedRequestInterceptor()],
                self.add_servicers,
                shared_token=self.opts.shared_token,
                metrics_port=self.opts.metrics_port,
                registry=self.registry,
                max_receive_bytes=self.receive_limit_bytes(),
                metrics_token=self.opts.shared_token if self.opts.metrics_require_token else None,
                ready=False,  # SERVING below, once the Steps socket (GetLoad's steps_socket) listens
            )
            self._health = health_servicer
            if getattr(self, "steps_servicer", None) is not None:  # decode / colocated
                frontend = self.frontend = await self._start_frontend()
            membership = await start_membership(self)
        except BaseException:
            # A port in use, a Steps socket that did not start, Redis unreachable: undo what started
            # (the transfer engine's threads at interpreter exit otherwise crash the process, and
            # a supervisor would read SIGSEGV instead of the error just logged).
            if frontend is not None:
                await frontend.stop()
            if server is not None:
                await server.stop(grace=None)
            self.engine_loop.stop()
            if self.backend is not None:
                self.backend.close()
            raise
        self.started = True
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        logger.info("%s node %s serving on %s (epoch %s)", self.opts.role, self.opts.name, addr, self.epoch)
        print(f"pdserve {self.opts.role} node {self.opts.name} ready on {addr}", flush=True)
        if ready is not None:
            ready.set()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.loop.add_signal_handler(sig, self._stop_draining)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        self._stop_event = stop
        if self.opts.faults.engine_death_on_sigusr1:
            self.loop.add_signal_handler(signal.SIGUSR1, self.inject_engine_death)
        if self.opts.faults.engine_stall_on_sigusr2_s:
            self.loop.add_signal_handler(signal.SIGUSR2, self.inject_engine_stall)
        self.engine_watchdog = EngineWatchdog(
            self.opts.name, self.engine_loop, self.engine.config.step_timeout_s, health_servicer
        )
        engine_watch = asyncio.create_task(self.engine_watchdog.run())
        mem_tasks = start_memwatch()
        watchdog = None
        if isinstance(self.engine.runner, (KVWorkers, PCPModelRunner)):  # worker processes to watch
            workers = StageWatchdog(
                self.opts.name, self.engine.runner, self.engine_loop, health_servicer, self._stop_with
            )
            watchdog = asyncio.create_task(workers.run())
        await stop.wait()
        engine_watch.cancel()
        for t in mem_tasks:
            t.cancel()
        if watchdog is not None:
            watchdog.cancel()
        if self._drain_on_stop:
            await drain(self, gate, health_servicer, membership)
        elif membership is not None:
            await membership.stop()
        await health_servicer.enter_graceful_shutdown()
        if frontend is not None:
            await frontend.stop()
        await server.stop(grace=2.0)
        self.engine_loop.stop()
        if self.backend is not None:
            self.backend.close()
        if self.kv_events is not None:
            self.kv_events.stop()
        tracing.shutdown_tracing()

    def inject_engine_death(self) -> None:
        """Test-only (``faults.engine_death_on_sigusr1``): kill the engine thread now."""
        assert self.engine_loop is not None
        node_faults.inject_engine_death(self.opts.name, self.engine_loop)

    def inject_engine_stall(self) -> None:
        """Test-only (``faults.engine_stall_on_sigusr2_s``): hold the engine thread in one
        command that long, as a wedged step would (the watchdog's case)."""
        assert self.engine_loop is not None
        node_faults.inject_engine_stall(
            self.opts.name, self.engine_loop, self.opts.faults.engine_stall_on_sigusr2_s
        )

    def _on_engine_death(self, e: BaseException) -> None:
        """Event loop, once: the engine thread died (its streams already ended with an error).
        NOT_SERVING at once so probes and the router stop sending; then stop and exit non-zero
        (``exit_code``) so a supervisor restarts the node with a fresh epoch."""
        logger.critical("node %s: engine died (%r); NOT_SERVING, exiting", self.opts.name, e)
        self.exit_code = EXIT_ENGINE_DIED
        self._death_task = asyncio.ensure_future(
            self._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        )
        assert self.loop is not None
        self.loop.call_later(ENGINE_DEATH_LINGER_S, self._stop_event.set)

    def _stop_with(self, exit_code: int) -> None:
        """A part of the node failed: stop now; the process exits with ``exit_code``."""
        self.exit_code = exit_code
        self._stop_event.set()

    async def _start_frontend(self) -> StepsFront:
        """The Steps socket (services/node_frontend.py); sets ``steps_socket`` to its address."""
        servicer = getattr(self, "steps_servicer", None)
        assert servicer is not None, "a Steps socket on a node without a Steps servicer"
        fe, self.steps_socket = await start_steps_front(servicer, self.opts)
        return fe

    def request_stop(self, drain: bool = False) -> None:
        """Stop serving; ``drain`` as on SIGTERM (tests of the drain), else at once (other tests)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._stop_draining if drain else self._stop_event.set)

    def _stop_draining(self) -> None:
        self._drain_on_stop = True
        self._stop_event.set()

    async def answer_load(self, pb: Any, context: grpc.aio.ServicerContext) -> Any:
        """GetLoad (services/node_load.py): the report, or UNAVAILABLE while starting or dead."""
        return await node_load.answer_load(self, pb, context)

    def load_report(self, pb: Any) -> Any:
        return node_load.load_report(self, pb)
