"""What every engine node (prefill, decode, colocated) shares: engine + KV transfer set-up, the gRPC server with health checking, metrics, and a clean shutdown."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from pdserve import tracing
from pdserve.config.choices import Role
from pdserve.config.node_spec import NodeSpec
from pdserve.distributed.pp_stage import KVWorkers, PipelineRunner, StageEndpoint
from pdserve.distributed.workers import WorkerError
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.errors import ConfigError, EngineDeadError
from pdserve.kvevents.publisher import KVEventPublisher, start_publisher
from pdserve.kvtransfer.backend import TransferBackend
from pdserve.kvtransfer.exposure import check_kv_ports, check_no_wildcard
from pdserve.kvtransfer.factory import make_backend
from pdserve.kvtransfer.group_transfer import kv_groups_wire, kv_tensors_of, shared_table_reason
from pdserve.kvtransfer.handshake import new_epoch
from pdserve.kvtransfer.runner_kv import drafter_kv_buffers, handshake_info_of, kv_regions_of
from pdserve.kvtransfer.speculative_compat import spec_wire
from pdserve.pcp.runner import PCPModelRunner
from pdserve.rpc.limits import node_receive_limit_bytes
from pdserve.rpc.malformed import MalformedRequestInterceptor
from services.engine_watchdog import EngineWatchdog
from services.memwatch import start_memwatch
from services.node_lifecycle import DrainGate, drain, start_grpc_server, start_membership
from services.node_metrics import NodeCollector
from services.steps_socket import StepsFront

logger = logging.getLogger(__name__)
EXIT_ENGINE_DIED = 70  # EX_SOFTWARE: the process exits with it after its engine thread died
ENGINE_DEATH_LINGER_S = 1.0  # NOT_SERVING is visible this long before the process exits
STAGE_WATCH_S = 0.5  # how often the node checks that its pipeline stage processes live


class InjectedEngineFault(BaseException):
    """Raised on the engine thread by ``faults.engine_death_on_sigusr1``: a BaseException, so the
    thread's command guard (which catches Exception) lets it through and the thread dies."""


class NodeBase:
    """Engine + transfer engine + gRPC server. Subclasses add their servicer."""

    def __init__(self, opts: NodeSpec) -> None:
        self.opts = opts
        self.epoch = new_epoch()
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
        if opts.frontend_port is not None:
            if opts.role is Role.PREFILL:
                raise ConfigError(
                    f"frontend_port {opts.frontend_port} on prefill node {opts.name}: a prefill node "
                    "serves no Steps streams; set it on decode or colocated nodes only"
                )
            if opts.frontend_port and opts.frontend_port in (opts.grpc_port, opts.metrics_port):
                raise ConfigError(
                    f"frontend_port {opts.frontend_port} of node {opts.name} is also its grpc or "
                    "metrics port: give it a distinct port"
                )
        kv_transfer = opts.role.moves_kv
        self.engine = LLMEngine(
            opts.engine,
            on_hold_for_transfer=self._on_hold if kv_transfer else None,
            shared_kv_table_reason=shared_table_reason(kv_transfer, opts.kv_checksum, opts.kv_transport),
        )
        self.backend: TransferBackend | None = None
        runner = self.engine.runner
        if opts.role.moves_kv:
            self.backend = make_backend(opts.kv_transport, opts.kv_host, str(runner.device))
            check_no_wildcard(
                opts.name, opts.kv_transport, opts.host, opts.allow_unauthenticated_kv_ports, self.backend
            )
            for cache in kv_tensors_of(runner):  # each KV group's tensor, or the one
                assert cache is not None
                self.backend.register(cache.data_ptr(), cache.numel() * cache.element_size())
            for addr, nbytes in drafter_kv_buffers(runner):  # an MTP module's KV moves too
                self.backend.register(addr, nbytes)
        self.regions = kv_regions_of(runner)  # stage 0's layers
        kv = self.engine.kv
        self.handshake = handshake_info_of(
            runner,
            opts.engine.model,
            self.epoch,
            opts.kv_transport,
            spec_wire(opts.engine.speculative),
            kv_groups_wire([m.spec for m in kv.coordinator.managers], kv.groups is not None),
        )
        # The node's KV endpoints, one per pipeline stage or TP rank (one when pp = tp = 1): each
        # its layers, KV heads, session, regions.
        ranges = (
            runner.ranges if isinstance(runner, PipelineRunner) else [(0, self.engine.arch.num_hidden_layers)]
        )
        session = self.backend.session_id if self.backend is not None else ""
        self.stages: list[StageEndpoint] = [
            StageEndpoint(
                0, len(ranges), ranges[0][0], ranges[0][1], session, tuple(self.regions), tp_size=tp
            )
        ]
        if isinstance(runner, KVWorkers) and self.backend is not None:
            self.stages += runner.start_kv_endpoints(opts.kv_transport, opts.kv_host)
        elif isinstance(runner, PipelineRunner):
            self.stages += [
                StageEndpoint(i, len(ranges), lo, hi, "", ()) for i, (lo, hi) in enumerate(ranges)
            ][1:]
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
        return pb.StageInfo(
            pp_rank=st.pp_rank,
            tp_rank=st.tp_rank,
            tp_size=st.tp_size,
            pp_size=st.pp_size,
            layer_start=st.layer_start,
            layer_end=st.layer_end,
            session=st.session,
        )

    def stage_loads(self, pb: Any) -> list[Any]:
        used = self.engine.kv.pool.num_used_blocks
        held, stranded = self.held_transfer_blocks(), self.stranded_kv_blocks()
        out = []
        for i, st in enumerate(self.stages):
            nbytes, failures, transfers = self.stage_transfer_counters(i)
            out.append(
                pb.StageLoad(
                    stage=self.stage_info(pb, st),
                    blocks_used=used,
                    blocks_held_for_transfer=held,
                    stranded_kv_blocks=stranded,
                    transfer_bytes=nbytes,
                    transfer_failures=failures,
                    transfers=transfers,
                )
            )
        return out

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
            watchdog = asyncio.create_task(self._watch_stages(self.engine.runner, health_servicer))
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
        logger.warning("node %s: injected engine death (faults.engine_death_on_sigusr1)", self.opts.name)

        def die(_engine: LLMEngine) -> None:
            raise InjectedEngineFault("injected engine death (faults.engine_death_on_sigusr1)")

        assert self.engine_loop is not None
        self.engine_loop.post(die)

    def inject_engine_stall(self) -> None:
        """Test-only (``faults.engine_stall_on_sigusr2_s``): hold the engine thread in one
        command that long, as a wedged step would (the watchdog's case)."""
        stall_s = self.opts.faults.engine_stall_on_sigusr2_s
        logger.warning(
            "node %s: injected engine stall of %g s (faults.engine_stall_on_sigusr2_s)",
            self.opts.name,
            stall_s,
        )
        assert self.engine_loop is not None
        self.engine_loop.post(lambda _engine: time.sleep(stall_s))

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

    async def _watch_stages(self, runner: KVWorkers | PCPModelRunner, health_servicer: Any) -> None:
        """A node is healthy only while every stage / TP / PCP rank process is (docs/design.md §7): a dead one turns
        health NOT_SERVING, fails every in-flight request with the reason, and stops the node
        with exit code 1 (a prefill's held KV is then freed by the peer's lease on decode)."""
        while True:
            await asyncio.sleep(STAGE_WATCH_S)
            try:
                runner.check_alive()
            except WorkerError as e:  # a pipeline stage, TP rank or PCP rank
                await self._out_of_service(str(e), health_servicer)
                return

    async def _out_of_service(self, reason: str, health_servicer: Any) -> None:
        """A process of this node died: NOT_SERVING, fail every request in flight, stop (exit 1)."""
        msg = f"node {self.opts.name} is out of service: {reason}"
        logger.error("%s", msg)
        await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert self.engine_loop is not None
        self.engine_loop.post_and_dispatch(functools.partial(LLMEngine.fail_all, message=msg))
        await asyncio.sleep(STAGE_WATCH_S)  # let the failed deltas reach their streams
        self.exit_code = 1
        self._stop_event.set()

    async def _start_frontend(self) -> StepsFront:
        """The Steps socket (services/steps_socket.py) on ``frontend_port`` (None or 0: any free
        port); returns once it listens, raises OSError naming the port if it cannot."""
        servicer = getattr(self, "steps_servicer", None)
        assert servicer is not None, "a Steps socket on a node without a Steps servicer"
        fe = StepsFront(
            servicer,
            self.opts.host,
            self.opts.frontend_port or 0,
            self.opts.shared_token,
            hello_timeout_s=self.opts.steps_hello_timeout_s,
            max_pending_per_peer=self.opts.steps_max_pending_per_peer,
        )
        await fe.start()
        host = (self.opts.advertise_address or f"{self.opts.host}:{self.opts.grpc_port}").rsplit(":", 1)[0]
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 literal
        self.steps_socket = f"{host}:{fe.port}"
        logger.info("node %s: Steps socket on %s", self.opts.name, self.steps_socket)
        return fe

    def request_stop(self, drain: bool = False) -> None:
        """Stop serving; ``drain`` as on SIGTERM (tests of the drain), else at once (other tests)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._stop_draining if drain else self._stop_event.set)

    def _stop_draining(self) -> None:
        self._drain_on_stop = True
        self._stop_event.set()

    async def answer_load(self, pb: Any, context: grpc.aio.ServicerContext) -> Any:
        """GetLoad: the report; UNAVAILABLE while the node is starting (its readiness is not
        SERVING yet: the report carries the Steps socket's address only once it listens) and
        once the engine died (the router drops the node)."""
        if not self.started:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"node {self.opts.name} is starting")
        try:
            return self.load_report(pb)
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    def load_report(self, pb: Any) -> Any:
        if self.engine_loop is not None:
            self.engine_loop.check_alive()  # a dead engine's counters are frozen: no report
        eng = self.engine
        st = eng.scheduler.stats()
        return pb.LoadReport(
            node=self.opts.name,
            role=self.opts.role,
            epoch=self.epoch,
            num_running=st.num_running,
            num_waiting=st.num_waiting + st.num_waiting_for_remote_kv,
            num_blocks_total=eng.kv.pool.num_blocks,
            num_blocks_used=eng.kv.pool.num_used_blocks,
            num_blocks_held_for_transfer=self.held_transfer_blocks(),
            num_held_requests=eng.kv.num_held_requests,
            stranded_kv_blocks=self.stranded_kv_blocks(),
            num_aborted_total=eng.num_aborted_total + self.aborted_holds_total(),
            block_size=eng.kv.block_size,
            stages=self.stage_loads(pb),
            num_ec_reservations=self.ec_reservations(),
            steps_socket=self.steps_socket,
            prefix_cache_queried_blocks=eng.kv.pool.num_queried_blocks,
            prefix_cache_hit_blocks=eng.kv.pool.num_hit_blocks,
            lora_idents=eng.lora.published_idents if eng.lora is not None else {},
        )
