"""The router process: OpenAI HTTP API (services.router.app) over the P/D backend."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import Any

import uvicorn

from pdserve import tracing
from pdserve.config.cluster import ClusterConfig
from pdserve.kvevents.consumer import ConsumerConfig, KVEventConsumer
from pdserve.kvevents.index import PrefixIndex
from pdserve.registry import registry_for
from services.gc_heap import freeze_startup_heap
from services.router.app import create_app
from services.router.cache_aware import CacheAwareWeights, KVEventsCollector
from services.router.discovery import NodeDiscovery, discovery_interval_s
from services.router.encoders import EncoderPool
from services.router.limits import RequestLimits
from services.router.metrics import RouterMetrics
from services.router.pd_backend import PDBackend, RouterPolicy
from services.sockets import listening_socket

logger = logging.getLogger(__name__)


async def serve_router(cluster: ClusterConfig, sock: socket.socket | None = None) -> None:
    """One router process; ``sock``: the listening socket its parent shares with other workers."""
    from pdserve.models.config import ModelArchConfig, generation_defaults
    from pdserve.models.loader import load_tokenizer
    from pdserve.models.resolve import resolve_model_path

    model = cluster.model
    assert model is not None, "the cluster config names no model"
    model_dir = resolve_model_path(model)  # a .gguf or an HF id: the nodes' folder (models/resolve.py)
    arch = ModelArchConfig.from_model_dir(model_dir)
    max_len = min(
        [n.max_model_len or arch.max_position_embeddings for n in cluster.decode_nodes]
        + [arch.max_position_embeddings]
    )
    r = cluster.router
    tracing.init_tracing("pdserve-router")  # OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set
    metrics = RouterMetrics()
    registry = registry_for(cluster)
    backend = PDBackend(
        prefill=[],
        decode=[],
        policy=RouterPolicy(
            policy=r.policy,
            cache_aware=CacheAwareWeights(
                r.cache_aware_block_cost,
                r.cache_aware_load_cost,
                r.cache_aware_kv_usage_cost,
                r.cache_aware_offload_hit_weight,
            ),
            local_prefill_max_tokens=r.local_prefill_max_tokens,
            prefill_timeout_s=r.prefill_timeout_s,
            request_timeout_s=r.request_timeout_s,
            decode_first_token_timeout_s=r.decode_first_token_timeout_s,
            inter_token_timeout_s=r.inter_token_timeout_s,
            breaker_failures=r.breaker_failures,
            breaker_open_s=r.breaker_open_s,
            nonstream_flush_ms=r.nonstream_flush_ms,
            stream_flush_ms=r.stream_flush_ms,
            pd_decode_leg=r.pd_decode_leg,
        ),
        shared_token=cluster.shared_token,
        registry=metrics.registry,
        discovered=True,
    )
    # EC producers of this model, from the cluster file (encoders do not join the node registry).
    encoders = EncoderPool(
        [(n.name, n.grpc_address) for n in cluster.encoder_nodes if n.model == model],
        timeout_s=r.encode_timeout_s,
        shared_token=cluster.shared_token,
        breaker_failures=r.breaker_failures,
        breaker_open_s=r.breaker_open_s,
    )
    mm = arch.mm_config
    image_token_id = image_seq_length = None
    if mm is not None:
        image_token_id = int(mm.get("image_token_id", mm.get("image_token_index", -1)))
        if not encoders:  # prefill encodes: the router needs the tokens per image itself
            from pdserve.models.clip_vision import ClipVisionConfig

            full = mm.get("vision_feature_select_strategy", "default") == "full"
            image_seq_length = ClipVisionConfig.from_hf(mm["vision_config"]).num_patches + int(full)
    discovery = NodeDiscovery(registry, backend, cluster, discovery_interval_s(cluster))
    await discovery.refresh()  # static: the file's nodes; Redis: whoever is registered now
    if registry.dynamic:
        discovery.start()
    backend.start()
    kv_events = None
    if r.policy == "cache_aware":
        assert cluster.redis_url  # ClusterConfig refuses cache_aware without it
        backend.prefix_index = PrefixIndex(r.prefix_index_max_blocks_per_node)
        kv_events = KVEventConsumer(
            cluster.redis_url,
            backend.prefix_index,
            lambda: [n.name for n in backend.prefill + backend.decode],
            ConsumerConfig.from_settings(cluster.kv_events),
        )
        kv_events.start()
        metrics.add_process_collector(KVEventsCollector(kv_events))
    app = create_app(
        backend,
        load_tokenizer(model_dir),
        [cluster.served_name(model)],
        max_len,
        api_key=r.api_key,
        metrics=metrics,
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        max_body_bytes=r.max_body_bytes,
        limits=RequestLimits(
            r.max_prompts_per_request,
            r.max_sequences_per_request,
            max_prompt_chars=r.max_prompt_chars,
            tokenizer_threads=r.tokenizer_threads,
            tokenize_timeout_s=r.tokenize_timeout_s,
        ),
        tool_call_parser=r.tool_call_parser,
        detokenize=r.detokenize,
        image_token_id=image_token_id,
        encoders=encoders,
        image_seq_length=image_seq_length,
        generation_defaults=generation_defaults(model_dir),
        max_grammar_bytes=r.max_grammar_bytes,
        lora_modules=dict(cluster.lora.modules) if cluster.lora is not None else None,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=r.host,
            port=r.port,
            log_level="warning",
            lifespan="off",
            # uvicorn's 5 s default closes idle keep-alive connections just as busy clients reuse
            # them (the soak's ReadError); clients and proxies expect a minute or more.
            timeout_keep_alive=int(r.http_keepalive_s),
        )
    )
    # uvicorn's protocol modules imported (serve() skips a loaded config), then the heap frozen:
    # the first requests meet no full collection of it (services/gc_heap.py)
    server.config.load()
    freeze_startup_heap("router" if sock is None else f"router worker {os.getpid()}")
    if sock is None:
        print(f"pdserve router ready on http://{r.host}:{r.port}/v1", flush=True)
    try:
        await server.serve(sockets=[sock] if sock is not None else None)
    finally:
        await discovery.close()
        if kv_events is not None:
            await kv_events.close()
        await backend.close()
        await encoders.close()
        tracing.shutdown_tracing()


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def run_router(cluster: ClusterConfig) -> None:
    # uvicorn re-raises SIGTERM / SIGINT once its graceful shutdown is done, so with the default
    # handlers a clean stop would read as "killed" (143) to compose and Kubernetes.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    if cluster.router.workers == 1:
        asyncio.run(serve_router(cluster))
    else:
        sys.exit(run_router_workers(cluster))


def _worker_main(cluster: ClusterConfig, sock: socket.socket | None, index: int, listening: Any) -> None:
    """One worker; ``sock`` None: it listens on its own socket of the SO_REUSEPORT group, then
    sets ``listening`` (the parent says "ready" once every worker has)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s router[{index}] %(levelname)s %(name)s: %(message)s"
    )
    if sock is None:
        sock = listening_socket(cluster.router.host, cluster.router.port, reuse_port=True)
    listening.set()
    asyncio.run(serve_router(cluster, sock))


# Linux spreads the connections of an SO_REUSEPORT group over its listening sockets by a hash
# of the connection. With one shared socket, whichever worker woke first accepted a burst (up to
# asyncio's 100 per wake-up): 64 connections landed 1.61 / 1.21 / 0.71 / 0.66 CPU s on 4 workers
# (CPU host), and the busiest worker capped streaming throughput.
BALANCED_ACCEPT = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")
EXIT_CANNOT_LISTEN = 71  # EX_OSERR, as a node whose port is taken (services.launch)


def run_router_workers(cluster: ClusterConfig) -> int:
    """``router.workers`` processes accepting on one listening socket (as uvicorn's and
    gunicorn's workers do): each has its own event loop, node connections (one Steps stream per
    node each) and registry view. The router is one unit: when a worker dies the others are
    stopped and the router exits non-zero, for the supervisor to restart it whole. /metrics of
    any worker shows the sum over all (prometheus_client's multiprocess mode)."""
    r = cluster.router
    metrics_dir = tempfile.mkdtemp(prefix="pdserve-router-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the spawned workers
    shared: socket.socket | None = None
    try:
        if BALANCED_ACCEPT:
            # Fails here if anything holds the port (a probe without SO_REUSEPORT, so another
            # process's group is refused too); then the parent keeps the port bound, not
            # listening (it accepts nothing), and each worker listens on its own socket.
            listening_socket(r.host, r.port, listen=False).close()
            sock = listening_socket(r.host, r.port, reuse_port=True, listen=False)
        else:
            sock = shared = listening_socket(r.host, r.port)
            sock.set_inheritable(True)
    except OSError as e:
        logger.critical("router cannot listen on %s:%d: %s", r.host, r.port, e.strerror or e)
        shutil.rmtree(metrics_dir, ignore_errors=True)
        return EXIT_CANNOT_LISTEN
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited threads or loops
    listening = [ctx.Event() for _ in range(r.workers)]
    workers = [
        ctx.Process(
            target=_worker_main,
            args=(cluster, shared, i, listening[i]),
            name=f"pdserve-router-{i}",
            daemon=False,
        )
        for i in range(r.workers)
    ]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 120.0
    for w, ev in zip(workers, listening, strict=True):
        while not ev.wait(0.2) and w.is_alive() and time.monotonic() < deadline:
            pass
    logger.info("router: %d workers on %s:%d (pids %s)", r.workers, r.host, r.port, [w.pid for w in workers])
    print(f"pdserve router ready on http://{r.host}:{r.port}/v1 ({r.workers} workers)", flush=True)
    code = 0
    try:
        while True:
            dead = [w for w in workers if not w.is_alive()]
            if dead:
                w = dead[0]
                code = w.exitcode if w.exitcode else 1
                logger.error(
                    "router worker %s (pid %s) exited with %s; stopping the router", w.name, w.pid, w.exitcode
                )
                break
            time.sleep(0.2)
    except SystemExit:  # SIGTERM / SIGINT: a clean stop of every worker
        code = 0
    finally:
        for w in workers:
            if w.is_alive():
                w.terminate()  # SIGTERM: each worker shuts uvicorn down gracefully
        deadline = time.monotonic() + 15.0
        for w in workers:
            w.join(max(0.0, deadline - time.monotonic()))
            if w.is_alive():
                w.kill()
                w.join()
        sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return code
