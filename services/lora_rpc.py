"""LoRA on a node: the LoadLoRA / UnloadLoRA calls both node services answer, and the check of a
request's adapter identity (prefill and decode admit a request only under the adapter content
the router named, so KV computed under one adapter is never continued under another)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import InvalidRequestError
from pdserve.lora.serving import LoRAServing
from pdserve.rpc import node_pb2 as pb


def adapters_pb(engine: LLMEngine) -> list[pb.LoRAAdapterInfo]:
    if engine.lora is None:
        return []
    return [
        pb.LoRAAdapterInfo(lora_name=n, ident=engine.lora.ident(n), path=engine.lora.manager.adapters[n].path)
        for n in engine.lora.names()
    ]


def request_lora_refusal(engine: LLMEngine, lora_name: str, lora_ident: str) -> str | None:
    """Why this node cannot run a request under (lora_name, lora_ident), or None when it can.
    An empty ident (a client of the node alone) checks the name only."""
    if not lora_name:
        return None if not lora_ident else f"lora_ident {lora_ident!r} without a lora_name"
    if engine.lora is None:
        return f"model {lora_name!r}: this node serves no LoRA adapters"
    if lora_name not in engine.lora.names():
        return f"model {lora_name!r}: this node does not hold that LoRA adapter (load it on every node)"
    ident = engine.lora.ident(lora_name)
    if lora_ident and ident != lora_ident:
        return f"model {lora_name!r}: this node holds {ident}, the request was prefilled under {lora_ident}"
    return None


async def check_request_lora(
    loop: EngineLoop | None, lora_name: str, lora_ident: str, context: grpc.aio.ServicerContext
) -> str:
    """The identity (name@hash, "" for the base model) the request runs under here; aborts the
    call with FAILED_PRECONDITION when the node cannot run the request's adapter."""
    assert loop is not None
    why = request_lora_refusal(loop.engine, lora_name, lora_ident)
    if why is not None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
    return loop.engine.lora.ident(lora_name) if lora_name and loop.engine.lora is not None else ""


async def _on_engine(
    loop: EngineLoop | None,
    fn: Callable[[LoRAServing, LLMEngine], bool],
    refused: grpc.StatusCode,
    context: grpc.aio.ServicerContext,
) -> pb.LoRAResponse:
    """Run ``fn`` on the engine thread; the node's adapters after it (``refused`` on a bad call)."""
    assert loop is not None
    if loop.engine.lora is None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node has no lora settings")

    def run(e: LLMEngine) -> pb.LoRAResponse:
        assert e.lora is not None
        newly = fn(e.lora, e)
        return pb.LoRAResponse(adapters=adapters_pb(e), newly_loaded=newly)

    try:
        return await loop.call(run)
    except InvalidRequestError as e:
        await context.abort(refused, str(e))
    raise AssertionError("context.abort raises")


async def load_lora(
    loop: EngineLoop | None, request: pb.LoRALoadRequest, context: grpc.aio.ServicerContext
) -> pb.LoRAResponse:
    """Load (same content under the name: nothing changes, newly_loaded false)."""
    name, path = request.lora_name, request.lora_path

    def load(lora: LoRAServing, _: LLMEngine) -> bool:
        before = name in lora.names()
        lora.load(name, path)
        return not before

    return await _on_engine(loop, load, grpc.StatusCode.INVALID_ARGUMENT, context)


async def unload_lora(
    loop: EngineLoop | None, request: pb.LoRAUnloadRequest, context: grpc.aio.ServicerContext
) -> pb.LoRAResponse:
    """Unload at once, or once the requests using it end (they finish under it)."""
    name = request.lora_name

    def unload(lora: LoRAServing, e: LLMEngine) -> bool:
        lora.unload(name, e.scheduler.requests.values())
        return False

    return await _on_engine(loop, unload, grpc.StatusCode.NOT_FOUND, context)


class _HasEngineLoop(Protocol):
    @property
    def engine_loop(self) -> EngineLoop | None: ...


class LoRAServicer:
    """LoadLoRA / UnloadLoRA of a node's gRPC service, the same on prefill and decode: mixed in
    before the generated servicer base, whose versions answer UNIMPLEMENTED."""

    node: _HasEngineLoop

    async def LoadLoRA(
        self, request: pb.LoRALoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoRAResponse:
        return await load_lora(self.node.engine_loop, request, context)

    async def UnloadLoRA(
        self, request: pb.LoRAUnloadRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoRAResponse:
        return await unload_lora(self.node.engine_loop, request, context)


def lora_metric_families(engine: LLMEngine, labels: list[str], values: list[str]) -> Iterator[Metric]:
    """The node's LoRA metrics (nothing without lora settings): adapters loaded, admitted
    requests per adapter, slot loads and evictions."""
    if engine.lora is None:
        return
    lora = engine.lora
    g = GaugeMetricFamily("pdserve:lora_adapters_loaded", "LoRA adapters loaded on the node", labels=labels)
    g.add_metric(values, len(lora.names()))
    yield g
    per = CounterMetricFamily(
        "pdserve:lora_requests", "Requests admitted under each LoRA adapter", labels=[*labels, "lora_name"]
    )
    for name, n in sorted(lora.requests_total.items()):
        per.add_metric([*values, name], n)
    yield per
    m = lora.manager.metrics
    for name, doc, value in (
        ("lora_slot_loads", "Adapters written into a resident slot", m.slot_loads),
        ("lora_slot_evictions", "Resident adapters evicted to host memory for another", m.slot_evictions),
    ):
        c = CounterMetricFamily(f"pdserve:{name}", doc, labels=labels)
        c.add_metric(values, value)
        yield c
