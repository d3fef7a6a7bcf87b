"""The router's OpenAI-compatible HTTP app, independent of how generation happens.

    create_app(backend, tokenizer, ["my-model"], max_model_len=4096) -> FastAPI

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (behind the
optional API key); ``POST /tokenize``, ``POST /detokenize``;
``GET /openapi.json``, ``GET /docs``, ``GET /health``, ``GET /version``, ``GET /metrics`` (always open, for
probes and scrapers).
"""

from __future__ import annotations

import importlib.metadata
import os
import secrets
import time
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.responses import Response

import pdserve
from pdserve.engine.grammar_spec import DEFAULT_MAX_GRAMMAR_BYTES
from pdserve.errors import CapacityError
from services.router.backend import GenerateBackend
from services.router.bodies import CheckedJSONRoute
from services.router.chat import create_chat_completion
from services.router.completions import create_completion
from services.router.dashboard import install_dashboard_routes
from services.router.errors import APIError, install_error_handlers
from services.router.limits import DEFAULT_MIN_BODY_BYTES, RequestLimits
from services.router.lora import RouterLoRA, adapter_models, install_lora_routes
from services.router.metrics import RouterMetrics
from services.router.middleware import RequestGuard
from services.router.prompt_embeds import max_prompt_embeds_bytes
from services.router.protocol import ChatCompletionRequest, CompletionRequest
from services.router.route_info import RouteHeaders
from services.router.serving import ServingContext
from services.router.streams import ClientDisconnected
from services.router.tokenize import install_tokenize_routes
from services.router.tool_parsers import check_parser

# nginx's "client closed request": logged, never seen by the (gone) client.
_STATUS_CLIENT_CLOSED = 499


def create_app(
    backend: GenerateBackend,
    tokenizer: Any,
    served_model_names: list[str],
    max_model_len: int,
    api_key: str | None = None,
    metrics: RouterMetrics | None = None,
    *,
    hidden_size: int | None = None,
    vocab_size: int | None = None,
    max_body_bytes: int | None = None,
    limits: RequestLimits | None = None,
    tool_call_parser: str = "hermes",
    detokenize: str = "router",
    image_token_id: int | None = None,
    encoders: Any | None = None,
    image_seq_length: int | None = None,
    generation_defaults: dict[str, float] | None = None,
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES,
    lora_modules: dict[str, str] | None = None,
) -> FastAPI:
    """Build the app.

    ``hidden_size`` enables prompt_embeds (their width); ``vocab_size`` defaults to
    ``len(tokenizer)``; ``max_body_bytes`` defaults to room for two base64 prompt_embeds of
    ``max_model_len`` float32 rows, and at least 16 MiB (``limits.DEFAULT_MIN_BODY_BYTES``).
    ``generation_defaults``: sampling values for fields a request leaves unset (the model's
    generation_config.json, ``models.config.generation_defaults``). ``lora_modules``: serve
    LoRA adapters (name -> path, those the nodes load at start; None: no adapters, no endpoints).
    """
    if not served_model_names:
        raise ValueError("served_model_names is empty: name at least one model to serve")
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    check_parser(tool_call_parser)  # a name nobody acts on is a start error
    if detokenize not in ("router", "node"):
        raise ValueError(f"detokenize must be 'router' or 'node', got {detokenize!r}")
    metrics = metrics if metrics is not None else RouterMetrics()
    ctx = ServingContext(
        backend=backend,
        tokenizer=tokenizer,
        served_model_names=tuple(served_model_names),
        max_model_len=max_model_len,
        metrics=metrics,
        vocab_size=vocab_size if vocab_size is not None else len(tokenizer),
        hidden_size=hidden_size,
        max_prompt_embeds_bytes=max_prompt_embeds_bytes(max_model_len, hidden_size or 0),
        limits=limits or RequestLimits(),
        tool_call_parser=tool_call_parser,
        detokenize_in_router=detokenize == "router",
        image_token_id=image_token_id,
        encoders=encoders,
        image_seq_length=image_seq_length,
        generation_defaults=dict(generation_defaults or {}),
        kv_capacity_tokens=getattr(backend, "kv_capacity_tokens", None),
        max_grammar_bytes=max_grammar_bytes,
        lora=RouterLoRA(served_model_names[0], dict(lora_modules), idents=getattr(backend, "lora_idents", {}))
        if lora_modules is not None
        else None,
    )
    if max_body_bytes is None:
        max_body_bytes = max(DEFAULT_MIN_BODY_BYTES, 2 * (ctx.max_prompt_embeds_bytes * 4) // 3)
    created = int(time.time())
    expected_auth = f"Bearer {api_key}".encode() if api_key else None

    async def check_api_key(request: Request) -> None:
        if expected_auth is None:
            return
        got = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(got, expected_auth):
            raise APIError(
                401,
                "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    # /openapi.json documents the request bodies, extras included (structured_outputs, top_k, ...).
    app = FastAPI(title="pdserve router", docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.router.route_class = CheckedJSONRoute  # every body: JSON of valid Unicode, or a 400 naming the field
    app.state.serving = ctx
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def _client_gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=_STATUS_CLIENT_CLOSED)

    app.add_middleware(RequestGuard, metrics=metrics, max_body_bytes=max_body_bytes)
    app.add_middleware(RouteHeaders)  # x-pdserve-prefill-node and the like

    guarded = [Depends(check_api_key)]

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request.receive)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request.receive)

    install_tokenize_routes(app, ctx, guarded)
    if ctx.lora is not None:
        install_lora_routes(app, backend, ctx.lora, guarded)
    install_dashboard_routes(app, backend, guarded)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> JSONResponse:
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pdserve",
                "max_model_len": ctx.max_len,
            }
            for name in served_model_names
        ]
        data += adapter_models(ctx.lora, created, ctx.max_len)
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        """Liveness: the router process answers."""
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        """The pdserve package's version, in vLLM's shape."""
        return JSONResponse({"version": package_version()})

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: a decode-capable node is reachable (what `pdserve up` and k8s wait for)."""
        try:
            await backend.check_capacity()
        except CapacityError as e:
            return Response(str(e), status_code=503)
        probe = getattr(backend, "ready", None)
        if probe is not None and not await probe():
            return Response("not every role has a reachable node yet", status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(_exposed(metrics)), media_type=CONTENT_TYPE_LATEST)

    return app


def package_version() -> str:
    """The installed distribution's version; ``pdserve.__version__`` when the package runs from a
    source tree that was never installed (no distribution metadata)."""
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return pdserve.__version__


def _exposed(metrics: RouterMetrics) -> CollectorRegistry:
    """What /metrics shows: with router workers (PROMETHEUS_MULTIPROC_DIR set by the parent
    process), every worker's values added up, plus the answering worker's process collectors
    (the prefix index: pdserve:router_prefix_index_blocks, router_kv_event*); else this
    process's registry."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return metrics.registry
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    for c in metrics.process_collectors:  # not in the files: this worker's own view
        registry.register(c)
    return registry
