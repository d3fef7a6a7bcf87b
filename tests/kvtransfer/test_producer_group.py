"""KVProducerGroup: a prefill node's answer to one pull (loopback backend, one stage): every
refusal reason, a push with its digest and first tokens, and the in-flight count."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from pdserve.kvtransfer.backend import LoopbackBackend
from pdserve.kvtransfer.connector import KVProducer
from pdserve.kvtransfer.handshake import HandshakeInfo
from pdserve.kvtransfer.peer import PullRequest
from pdserve.kvtransfer.producer_group import KVProducerGroup, PullRefusal, PullRefusedError
from pdserve.kvtransfer.regions import regions_for_kv_cache

GEOM = dict(block_size=4, num_kv_heads=2, head_dim=8, elem_bytes=4)
NAMES = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
HS = HandshakeInfo(
    model_id="m",
    dtype="float32",
    block_size=4,
    layer_names=tuple(NAMES),
    num_kv_heads=2,
    head_dim=8,
    epoch="e1",
)


def _side(value: float):
    per_block = 2 * GEOM["block_size"] * GEOM["num_kv_heads"] * GEOM["head_dim"]
    cache = torch.full((8, len(NAMES), per_block), value, dtype=torch.float32)
    backend = LoopbackBackend()
    backend.register(cache.data_ptr(), cache.numel() * 4)
    return cache, backend, regions_for_kv_cache(cache.data_ptr(), 8, NAMES, **GEOM)


@pytest.fixture
def env():
    _src_cache, src_backend, src_regions = _side(1.0)  # kept alive: registered memory
    dst_cache, dst_backend, dst_regions = _side(0.0)
    released: list[str] = []
    prod = KVProducer(src_backend, src_regions, 4, released.append, lease_s=60.0)
    digests: list[tuple[int, ...]] = []

    def digest(block_ids) -> str:
        digests.append(tuple(block_ids))
        return "abc"

    group = KVProducerGroup([prod], HS, ready_timeout_s=0.2, digest=digest)
    pull = PullRequest(
        transfer_id="t",
        dst_block_ids=(5, 6),
        num_tokens=8,
        dst_regions=tuple(dst_regions),
        dst_session=dst_backend.session_id,
        dst_compat_hash=HS.compat_hash,
        expected_src_epoch="e1",
        want_checksum=False,
        dst_pp_rank=0,
        dst_tp_rank=0,
        dst_pp_size=1,
        dst_layer_start=0,
        dst_layer_end=2,
        early=False,
    )
    yield group, prod, pull, dst_cache, released, digests
    src_backend.close()
    dst_backend.close()


async def test_a_held_transfer_is_pushed_with_its_digest_and_first_tokens(env):
    group, prod, pull, dst_cache, released, digests = env
    prod.admit("t")
    prod.on_hold("t", [0, 1, 2], 1, [42])
    out = await group.serve(replace(pull, want_checksum=True))
    assert out.ok and out.stages == [0] and out.first_token_ids == [42] and out.checksum == "abc"
    assert digests == [(0, 1)]  # the blocks 8 tokens cover, taken before the push freed them
    assert torch.all(dst_cache[5:7] == 1.0) and torch.all(dst_cache[7] == 0.0)
    assert released == ["t"] and group.pushes_in_flight == 0


async def test_an_early_pull_waits_for_the_hold_and_counts_in_flight_only_then(env):
    group, prod, pull, *_ = env
    group.ready_timeout_s = 5.0
    task = asyncio.create_task(group.serve(replace(pull, early=True)))
    await asyncio.sleep(0.05)
    assert not task.done() and group.pushes_in_flight == 0
    prod.admit("t")
    prod.on_hold("t", [0, 1], 1, [7])
    assert (await asyncio.wait_for(task, 5)).first_token_ids == [7]


@pytest.mark.parametrize(
    ("change", "held", "refusal", "words"),
    [
        (dict(expected_src_epoch="e0"), True, PullRefusal.STALE, "prefill restarted"),
        (dict(dst_compat_hash="x"), True, PullRefusal.STALE, "compat hash differs"),
        (dict(transfer_id="nope"), True, PullRefusal.NOT_FOUND, "unknown transfer_id 'nope'"),
        ({}, False, PullRefusal.NOT_READY, "not ready in time"),
        (dict(dst_pp_rank=2, dst_pp_size=2), True, PullRefusal.INVALID, "dst_pp_rank 2"),
        (dict(dst_block_ids=(5,)), True, PullRefusal.INVALID, "destination blocks"),
        ("half_blocks", True, PullRefusal.INVALID, "KV region mismatch for layer 'model.layers.0.self_attn'"),
    ],
)
async def test_refusals(env, change, held, refusal, words):
    group, prod, pull, _dst, released, _ = env
    prod.admit("t")
    if held:
        prod.on_hold("t", [0, 1], 1, [1])
    if change == "half_blocks":  # decode's layer 0 with a different block size
        r0 = pull.dst_regions[0]
        change = dict(dst_regions=(replace(r0, block_bytes=r0.block_bytes // 2), *pull.dst_regions[1:]))
    with pytest.raises(PullRefusedError, match=words) as e:
        await group.serve(replace(pull, **change))
    assert e.value.refusal is refusal and group.pushes_in_flight == 0 and released == []


async def test_a_checksum_from_several_stages_is_unsupported(env):
    group, prod, pull, *_ = env
    group.producers.append(prod)  # a second stage (sharing the tracker)
    prod.admit("t")
    prod.on_hold("t", [0, 1], 1, [1])
    with pytest.raises(PullRefusedError) as e:
        await group.serve(replace(pull, want_checksum=True))
    assert e.value.refusal is PullRefusal.UNSUPPORTED
