"""What every engine node (prefill, decode, colocated) shares: options, engine + KV transfer
set-up, the gRPC server with health checking, metrics, and a clean shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.config.engine import EngineConfig
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kvtransfer.backend import TransferBackend
from pdserve.kvtransfer.connector import handshake_info_of, kv_regions_of
from pdserve.kvtransfer.factory import make_backend
from pdserve.kvtransfer.handshake import new_epoch
from pdserve.rpc import channel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeOptions:
    name: str
    role: str  # prefill | decode | colocated
    engine: EngineConfig
    host: str = "127.0.0.1"
    grpc_port: int = 50061
    metrics_port: int | None = None
    kv_host: str = "127.0.0.1"  # address peers reach our transfer engine at
    kv_transport: str = "tcp"  # tcp | rdma (Mooncake) | cuda_ipc (same-host GPUs)
    kv_lease_s: float = 30.0
    kv_ready_timeout_s: float = 60.0  # prefill: how long a push waits for the KV to exist
    kv_pull_timeout_s: float = 60.0  # decode: how long one pull may take before the policy applies
    kv_load_failure_policy: str = "recompute"  # fail | recompute (reprefill is the router's)
    shared_token: str | None = None


class NodeBase:
    """Engine + transfer engine + gRPC server. Subclasses add their servicer."""

    def __init__(self, opts: NodeOptions) -> None:
        self.opts = opts
        self.epoch = new_epoch()
        self.engine = LLMEngine(opts.engine, on_hold_for_transfer=self._on_hold)
        self.backend: TransferBackend | None = None
        if opts.role in ("prefill", "decode"):
            self.backend = make_backend(opts.kv_transport, opts.kv_host, str(self.engine.runner.device))
            cache = self.engine.runner.kv_cache
            assert cache is not None
            self.backend.register(cache.data_ptr(), cache.numel() * cache.element_size())
        self.regions = kv_regions_of(self.engine.runner)
        self.handshake = handshake_info_of(self.engine.runner, opts.engine.model, self.epoch)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.engine_loop: EngineLoop | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_NodeCollector(self))

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

    # lifecycle -----------------------------------------------------------------------------------
    async def serve(self, ready: asyncio.Event | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.engine_loop = EngineLoop(self.engine, self.loop, self._on_kv_loads, self._on_step)
        self.engine_loop.start()
        interceptors = (
            [channel.TokenAuthInterceptor(self.opts.shared_token)] if self.opts.shared_token else []
        )
        server = grpc.aio.server(options=channel.SERVER_OPTIONS, interceptors=interceptors)
        self.add_servicers(server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        addr = f"{self.opts.host}:{self.opts.grpc_port}"
        if server.add_insecure_port(addr) == 0:
            raise OSError(f"cannot bind gRPC port {addr}")
        await server.start()
        if self.opts.metrics_port:
            start_http_server(self.opts.metrics_port, addr=self.opts.host, registry=self.registry)
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        logger.info("%s node %s serving on %s (epoch %s)", self.opts.role, self.opts.name, addr, self.epoch)
        print(f"pdserve {self.opts.role} node {self.opts.name} ready on {addr}", flush=True)
        if ready is not None:
            ready.set()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        self._stop_event = stop
        await stop.wait()
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace=2.0)
        self.engine_loop.stop()
        if self.backend is not None:
            self.backend.close()

    def request_stop(self) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._stop_event.set)

    def load_report(self, pb: Any) -> Any:
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
            num_aborted_total=eng.num_aborted_total,
            block_size=eng.kv.block_size,
        )


class _NodeCollector:
    """Reads engine counters at scrape time (plain int reads; no lock needed for metrics)."""

    def __init__(self, node: NodeBase) -> None:
        self.node = node

    def collect(self):  # type: ignore[no-untyped-def]
        n = self.node
        eng = n.engine
        pool = eng.kv.pool
        st = eng.scheduler.stats()
        labels = ["node", "role"]
        lv = [n.opts.name, n.opts.role]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"pdserve:{name}", doc, labels=labels)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"pdserve:{name}", doc, labels=labels)
            c.add_metric(lv, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch", st.num_running)
        yield gauge("num_requests_waiting", "Requests waiting (incl. for remote KV)", st.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use", pool.usage)
        yield gauge("kv_blocks_used", "KV blocks in use", pool.num_used_blocks)
        yield gauge("kv_blocks_free", "KV blocks free", pool.num_free_blocks)
        yield gauge("kv_blocks_cached", "KV blocks holding a prefix-cache entry", pool.num_cached_blocks)
        yield gauge("kv_blocks_held_for_transfer", "Prefill blocks held for a pull", n.held_transfer_blocks())
        yield gauge("stranded_kv_blocks", "Blocks held that no live peer will read", n.stranded_kv_blocks())
        yield gauge("prefix_cache_hit_rate", "Prefix-cache block hit rate", pool.hit_rate)
        yield counter("num_preemptions", "Preemptions by recompute", st.num_preemptions_total)
        yield counter("requests_aborted", "Requests aborted on this node", eng.num_aborted_total)
        for name, doc, value in n.transfer_counters():
            yield counter(name, doc, value)

    def describe(self):  # type: ignore[no-untyped-def]
        return []
