"""The router hashes an adapter's prompt blocks as the engine does (salted by the adapter's
content hash): the hashes a node publishes (KV events: block_stored) for an adapter request are
the ones the router looks up, and the base model's hashes of the same prompt are not."""

from __future__ import annotations

import asyncio

from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvevents.index import PrefixIndex
from pdserve.lora.ident import lora_block_salt
from services.router.backend import BackendRequest
from services.router.cache_aware import RouteKey
from services.router.pd_backend import PDBackend, RouterPolicy
from tests.lora.adapters import make_adapter

BS = 16


class _Stored:
    def __init__(self) -> None:
        self.hashes: list[bytes] = []

    def block_stored(self, block_hash: bytes, parent_hash: bytes | None) -> None:
        self.hashes.append(block_hash)

    def block_removed(self, block_hash: bytes) -> None:
        pass


def test_router_block_hashes_carry_the_adapter(tiny_model_factory, tmp_path, make_llm):
    model_dir = tiny_model_factory("llama")
    path = make_adapter(model_dir, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj"])
    llm = make_llm(
        model_dir, kv_cache_memory_bytes=8 << 20, block_size=BS, lora={"modules": {"a": str(path)}}
    )
    stored = _Stored()
    llm.engine.kv.pool.listener = stored
    prompt = list(range(3, 3 + 3 * BS + 5))  # three full blocks
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), lora_request="a")

    idents = {"a": llm.engine.lora.ident("a")}  # what the router learns from a load or prefill's answer
    assert llm.engine.lora.published_idents == idents  # what the node's load reports carry
    salt = lora_block_salt(idents, "a")
    assert salt is not None and salt == llm.engine.lora.manager.adapters["a"].content_hash
    router = hash_prompt_blocks(prompt, BS, salt)
    assert len(router) == 3 and router == stored.hashes[:3]
    assert not set(hash_prompt_blocks(prompt, BS)) & set(stored.hashes)  # the unsalted (base) ones
    # another block size (a node hashing at its own) keeps the salt
    key = RouteKey(router[-1], router, prompt, BS, salt)
    assert key.hashes_for(8) == hash_prompt_blocks(prompt, 8, salt) != hash_prompt_blocks(prompt, 8)
    # the base model hashes unsalted; an adapter whose identity is not known yet is not hashed
    assert lora_block_salt(idents, "") == b"" and lora_block_salt(idents, "b") is None


def test_pd_backend_uses_the_adapter_salt():
    """The decode node holds an adapter's blocks (KV events): that adapter's prompt prefills
    there; the base model's same prompt, and an adapter the router has no identity for, do not."""
    digest = "11" * 16
    prompt = list(range(3, 3 + 4 * BS))

    async def run() -> None:
        be = PDBackend(
            [("p0", "127.0.0.1:1")],
            [("d0", "127.0.0.1:2")],
            RouterPolicy(policy="cache_aware", local_prefill_max_tokens=1),
        )
        try:
            be.prefix_index = PrefixIndex()
            d0 = be.decode[0]
            req = BackendRequest("r", prompt, SamplingParams(), lora_name="a")
            assert be.prompt_hashes(req, BS) == []  # identity not known yet: no hashes
            be.lora_idents["a"] = "a@" + digest  # learnt from a load or a prefill answer
            salted = be.prompt_hashes(req, BS)
            assert salted == hash_prompt_blocks(prompt, BS, bytes.fromhex(digest)) and len(salted) == 4
            for h in salted:
                be.prefix_index.add("d0", h)
            assert be.prefill_locally(req, salted, d0)
            base = BackendRequest("b", prompt, SamplingParams())
            assert be.prompt_hashes(base, BS) == hash_prompt_blocks(prompt, BS)
            assert not be.prefill_locally(base, be.prompt_hashes(base, BS), d0)
        finally:
            await be.close()

    asyncio.run(run())


def test_load_reports_teach_the_router_adapter_identities():
    """A cluster without a prefill node: the router learns an adapter's identity from a decode
    node's load report (real gRPC; the node's side is a servicer answering GetLoad)."""
    import grpc

    from pdserve.rpc import node_pb2 as pb
    from pdserve.rpc import node_pb2_grpc as pb_grpc

    ident = "a@" + "22" * 16

    reports = [{"a": ident}, {}]

    class _Load(pb_grpc.DecodeServiceServicer):
        async def GetLoad(self, request, context):
            return pb.LoadReport(node="d0", role="decode", block_size=BS, lora_idents=reports[0])

    async def run() -> None:
        server = grpc.aio.server()
        pb_grpc.add_DecodeServiceServicer_to_server(_Load(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        be = PDBackend([], [("d0", f"127.0.0.1:{port}")], RouterPolicy(policy="cache_aware"))
        try:
            req = BackendRequest("r", list(range(3, 3 + 2 * BS)), SamplingParams(), lora_name="a")
            assert be.prompt_hashes(req, BS) == []
            await be._poll_one(be.decode[0])
            assert be.decode[0].healthy and be.lora_idents == {"a": ident}
            assert be.prompt_hashes(req, BS) == hash_prompt_blocks(
                req.prompt_token_ids, BS, bytes.fromhex("22" * 16)
            )
            reports.pop(0)  # unloaded on the only node that had it: forgotten
            await be._poll_one(be.decode[0])
            assert be.lora_idents == {} and be.prompt_hashes(req, BS) == []
        finally:
            await be.close()
            await server.stop(None)

    asyncio.run(run())
