"""LoRA adapters at the router (vLLM's shapes): ``POST /v1/load_lora_adapter`` {lora_name,
lora_path} and ``POST /v1/unload_lora_adapter`` {lora_name}, applied to every node of the model;
requests name an adapter in ``model``; ``/v1/models`` lists adapters with ``parent`` = the base.

A load is all-or-nothing: every node loads; if one refuses (bad folder, rank, shapes) or the
nodes read different content under the name, the nodes that loaded it anew unload it again and
the answer is a 400 naming the problem. The registry lives in this router process (adapters of
the cluster file's ``lora.modules`` from the start); ``lora`` refuses router.workers > 1.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc
from fastapi import FastAPI
from fastapi.params import Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from services.router.errors import APIError, bad_request

LORA_ADMIN_TIMEOUT_S = 120.0  # one node's LoadLoRA / UnloadLoRA (reads and checks the folder)


class LoadLoRABody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRABody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM sends it; the name identifies the adapter


@dataclass
class RouterLoRA:
    """The adapters this router serves: name -> path (mutated by the endpoints below)."""

    base_name: str
    adapters: dict[str, str] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # name -> identity (name@hash) the nodes answered with: set by loads here and by prefill's
    # answers (the backend's lora_idents, the same dict); it salts the adapter's block hashes
    idents: dict[str, str] = field(default_factory=dict)


def _stub(node: Any) -> Any:
    if node.role == "prefill":
        return pb_grpc.PrefillServiceStub(node.channel)
    return pb_grpc.DecodeServiceStub(node.channel)


def _nodes(backend: Any) -> list[Any]:
    return [*getattr(backend, "prefill", []), *getattr(backend, "decode", [])]


async def _call_all(backend: Any, method: str, msg: Any) -> list[tuple[Any, Any]]:
    """(node, LoRAResponse or AioRpcError) for every node of the backend."""
    nodes = _nodes(backend)
    md = getattr(backend, "_md", None)

    async def one(node: Any) -> Any:
        try:
            return await getattr(_stub(node), method)(msg, timeout=LORA_ADMIN_TIMEOUT_S, metadata=md)
        except grpc.aio.AioRpcError as e:
            return e

    return list(zip(nodes, await asyncio.gather(*(one(n) for n in nodes)), strict=True))


async def load_everywhere(backend: Any, lora: RouterLoRA, name: str, path: str) -> str:
    """Load on every node or on none; the adapter's identity (name@hash) on success."""
    if name == lora.base_name:
        raise bad_request(f"lora_name {name!r} is the base model's name", "lora_name")
    results = await _call_all(backend, "LoadLoRA", pb.LoRALoadRequest(lora_name=name, lora_path=path))
    if not results:
        raise APIError(503, "no node is known to load the adapter on", code="no_nodes")
    errors = [(n, r) for n, r in results if isinstance(r, grpc.aio.AioRpcError)]
    idents = {
        info.ident
        for _, r in results
        if not isinstance(r, grpc.aio.AioRpcError)
        for info in r.adapters
        if info.lora_name == name
    }
    if errors or len(idents) != 1:
        fresh = [n for n, r in results if not isinstance(r, grpc.aio.AioRpcError) and r.newly_loaded]
        unload = pb.LoRAUnloadRequest(lora_name=name)
        md = getattr(backend, "_md", None)
        await asyncio.gather(
            *(_stub(n).UnloadLoRA(unload, timeout=LORA_ADMIN_TIMEOUT_S, metadata=md) for n in fresh),
            return_exceptions=True,
        )
        if errors:
            node, e = errors[0]
            status = 400 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 503
            raise APIError(status, f"node {node.name}: {e.details()}", param="lora_path")
        raise bad_request(
            f"lora_path {path!r}: the nodes read different adapter content ({sorted(idents)}); give every "
            "node the same folder",
            "lora_path",
        )
    lora.adapters[name] = path
    ident = lora.idents[name] = idents.pop()
    return ident


async def unload_everywhere(backend: Any, lora: RouterLoRA, name: str) -> None:
    if name not in lora.adapters:
        raise APIError(404, f"lora_name {name!r} is not loaded", param="lora_name", code="model_not_found")
    results = await _call_all(backend, "UnloadLoRA", pb.LoRAUnloadRequest(lora_name=name))
    del lora.adapters[name]  # new requests stop at the router; the nodes finish those in flight
    lora.idents.pop(name, None)
    errors = [
        (n, r)
        for n, r in results
        if isinstance(r, grpc.aio.AioRpcError) and r.code() != grpc.StatusCode.NOT_FOUND
    ]
    if errors:
        node, e = errors[0]
        raise APIError(503, f"node {node.name}: {e.details()}", param="lora_name")


def install_lora_routes(app: FastAPI, backend: Any, lora: RouterLoRA, guarded: list[Depends]) -> None:
    @app.post("/v1/load_lora_adapter", dependencies=guarded)
    async def load_lora_adapter(body: LoadLoRABody) -> JSONResponse:
        async with lora.lock:
            ident = await load_everywhere(backend, lora, body.lora_name, body.lora_path)
        return JSONResponse({"lora_name": body.lora_name, "ident": ident, "status": "loaded"})

    @app.post("/v1/unload_lora_adapter", dependencies=guarded)
    async def unload_lora_adapter(body: UnloadLoRABody) -> JSONResponse:
        async with lora.lock:
            await unload_everywhere(backend, lora, body.lora_name)
        return JSONResponse({"lora_name": body.lora_name, "status": "unloaded"})


def adapter_models(lora: RouterLoRA | None, created: int, max_len: int) -> list[dict[str, Any]]:
    """/v1/models entries of the adapters (vLLM's shape: root = the path, parent = the base)."""
    if lora is None:
        return []
    return [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "pdserve",
            "root": path,
            "parent": lora.base_name,
            "max_model_len": max_len,
        }
        for name, path in lora.adapters.items()
    ]
