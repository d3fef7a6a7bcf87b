"""The encoder node (EC producer): gRPC EncoderService over ``EncoderCore`` + ``EmbeddingProducer``.

    router --Encode(images)----------> encoder: decode (limits), hit? key : tower + projector
           <-(key, length, hit)------           -> registered buffer, Redis index (ttl = lease)
    prefill --PushEmbeddings(key, dst)-> encoder: one Mooncake write into prefill's reservation
            <-(bytes)------------------

A bad image is INVALID_ARGUMENT (the router answers 400); a full buffer that cannot take one
embedding is RESOURCE_EXHAUSTED; a key no longer cached (evicted) is NOT_FOUND. Health, token
auth and the SIGTERM stop work as on the engine nodes; the encoder holds no KV, so its drain is
only "finish the calls in flight".
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry, Gauge

from pdserve import tracing
from pdserve.config.node_spec import NodeSpec
from pdserve.embedcache.connector import EmbeddingProducer
from pdserve.embedcache.index import EmbeddingIndex
from pdserve.errors import CapacityError, ConfigError, InvalidRequestError
from pdserve.kvtransfer.backend import TransferError
from pdserve.kvtransfer.exposure import check_kv_ports, check_no_wildcard
from pdserve.kvtransfer.factory import make_backend
from pdserve.kvtransfer.handshake import new_epoch
from pdserve.models.image_processor import ClipImageProcessor
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from pdserve.rpc.limits import encoder_receive_limit_bytes
from pdserve.rpc.malformed import MalformedRequestInterceptor
from services.encoder.core import EncoderCore, EncoderMetrics, ImageInput
from services.gc_heap import freeze_startup_heap
from services.node_lifecycle import start_grpc_server

logger = logging.getLogger(__name__)


class EncoderNode:
    """An encoder node from its spec: ``engine`` gives the checkpoint, device and dtype; the
    buffer, lease and image limits are the entry's ``ec_buffer_bytes``, ``ec_lease_s`` and
    ``max_image_bytes`` / ``max_image_pixels``."""

    def __init__(self, opts: NodeSpec) -> None:
        from pdserve.engine.device import resolve_device, resolve_dtype
        from pdserve.models.llava import LlavaForConditionalGeneration
        from pdserve.models.loader import load_model

        self.opts = opts
        self.epoch = new_epoch()
        check_kv_ports(
            opts.name, opts.kv_transport, opts.host, opts.kv_host, opts.allow_unauthenticated_kv_ports
        )
        device = resolve_device(opts.engine.device)
        model_dir = opts.engine.model
        model, _ = load_model(model_dir, resolve_dtype(opts.engine.dtype, device), device)
        if not isinstance(model, LlavaForConditionalGeneration):
            raise ConfigError(f"model {model_dir!r} has no vision tower: an encoder needs a LLaVA model")
        assert opts.redis_url is not None  # the cluster file refuses an encoder without it
        self.registry = CollectorRegistry()
        self.backend = make_backend(opts.kv_transport, opts.kv_host, "cpu")
        check_no_wildcard(
            opts.name, opts.kv_transport, opts.host, opts.allow_unauthenticated_kv_ports, self.backend
        )
        self.producer = EmbeddingProducer(
            opts.name,
            self.backend,
            EmbeddingIndex.from_url(opts.redis_url),
            opts.ec_buffer_bytes,
            opts.ec_lease_s,
            registry=self.registry,
        )
        limits = opts.image_limits
        self.max_image_bytes = limits.max_image_bytes
        self.core = EncoderCore(
            model,
            ClipImageProcessor.from_model_dir(model_dir),
            self.producer,
            limits,
            EncoderMetrics(self.registry),
        )
        self.in_flight = 0
        self._lock = threading.Lock()
        Gauge(
            "pdserve:ec_cached_embeddings", "Embeddings in the encoder's buffer", registry=self.registry
        ).set_function(lambda: self.producer.num_cached)
        Gauge(
            "pdserve:ec_buffer_bytes_used", "Bytes of the encoder's buffer in use", registry=self.registry
        ).set_function(lambda: self.producer.bytes_used)

    async def serve(self, ready: asyncio.Event | None = None) -> None:
        tracing.init_tracing("pdserve-encoder")  # OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set
        server, hs, addr = await start_grpc_server(
            self.opts.host,
            self.opts.grpc_port,
            [MalformedRequestInterceptor()],
            lambda s: pb_grpc.add_EncoderServiceServicer_to_server(EncoderServicer(self), s),
            shared_token=self.opts.shared_token,
            metrics_port=self.opts.metrics_port,
            registry=self.registry,
            max_receive_bytes=encoder_receive_limit_bytes(self.max_image_bytes),
            metrics_token=self.opts.shared_token if self.opts.metrics_require_token else None,
        )
        print(f"pdserve encoder node {self.opts.name} ready on {addr}", flush=True)
        if ready is not None:
            ready.set()
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        self.loop = loop
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        await self._stop.wait()
        # Drain: not ready any more, let the calls in flight end (bounded), then stop.
        await hs.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + self.opts.drain_timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await hs.enter_graceful_shutdown()
        await server.stop(grace=2.0)
        self.producer.close()  # entries leave the index at once: their bytes are gone with us
        self.backend.close()

    def request_stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)


class EncoderServicer(pb_grpc.EncoderServiceServicer):
    def __init__(self, node: EncoderNode) -> None:
        self.node = node

    async def Encode(self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext) -> pb.EncodeResponse:
        node = self.node
        if not request.images:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Encode needs at least one image")
        images = [ImageInput(im.data, im.uuid or None) for im in request.images]
        t_call = time.monotonic()
        node.in_flight += 1
        try:
            if node.opts.faults.encode_delay_s:
                await asyncio.sleep(node.opts.faults.encode_delay_s)
            out = await asyncio.to_thread(node.core.encode, images)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except CapacityError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        finally:
            node.in_flight -= 1
        if tracing.enabled():  # a child of the router's router.encode span
            tracing.record(
                "encoder.encode",
                tracing.context_of(tracing.metadata_traceparent(context.invocation_metadata())),
                t_call,
                time.monotonic(),
                **{
                    "pdserve.node": node.opts.name,
                    "pdserve.images": len(images),
                    "pdserve.cache_hits": sum(e.cache_hit for e in out),
                },
            )
        return pb.EncodeResponse(
            items=[pb.EncodeItem(key=e.key, length=e.length, cache_hit=e.cache_hit) for e in out],
            node=node.opts.name,
            address=node.opts.advertise_address,
        )

    async def PushEmbeddings(
        self, request: pb.EncoderPushRequest, context: grpc.aio.ServicerContext
    ) -> pb.EncoderPushResponse:
        node = self.node
        t0 = time.monotonic()
        node.in_flight += 1
        try:
            if node.opts.faults.ec_push_delay_s:
                await asyncio.sleep(node.opts.faults.ec_push_delay_s)
            await asyncio.to_thread(
                node.producer.push,
                request.key,
                request.dst_session,
                request.dst_addr,
                request.nbytes,
                request.transfer_id or request.key,
            )
        except KeyError:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"embedding {request.key!r} is not cached here (evicted?)"
            )
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TransferError as e:  # a failed Mooncake write: names the peer and the code
            logger.warning("push of %s to %s failed: %s", request.key, request.dst_session, e)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"embedding push failed: {e}")
        finally:
            node.in_flight -= 1
        return pb.EncoderPushResponse(bytes=request.nbytes, seconds=time.monotonic() - t0)

    async def GetLoad(
        self, request: pb.LoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.EncoderLoadReport:
        p = self.node.producer
        return pb.EncoderLoadReport(
            node=self.node.opts.name,
            epoch=self.node.epoch,
            num_cached=p.num_cached,
            buffer_bytes_used=p.bytes_used,
            buffer_bytes_total=p.buffer.numel(),
            num_in_flight=self.node.in_flight,
        )


def run_encoder(opts: NodeSpec) -> None:
    node = EncoderNode(opts)
    freeze_startup_heap(f"encoder node {opts.name}")  # vision tower loaded (services/gc_heap.py)
    asyncio.run(node.serve())
