"""Two real OS processes moving KV-cache memory through MooncakeBackend (TCP, P2PHANDSHAKE, loopback)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp

import pytest

pytest.importorskip("mooncake.engine")
torch = pytest.importorskip("torch")

from pdserve.kvtransfer.backend import MooncakeBackend, TransferError  # noqa: E402
from pdserve.kvtransfer.regions import DescriptorPlan, align_regions, regions_for_kv_cache  # noqa: E402

pytestmark = pytest.mark.slow

# [num_blocks, L, 2, block_size, Hkv, D] fp16: 64 blocks x 64 KiB = 4 MiB per side
SHAPE = (64, 4, 2, 16, 4, 64)
LAYERS = [f"model.layers.{i}" for i in range(SHAPE[1])]
GEOM = dict(block_size=SHAPE[3], num_kv_heads=SHAPE[4], head_dim=SHAPE[5], elem_bytes=2)


def _sha(t) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _decode_peer(conn) -> None:
    """The decode side: owns the target KV cache, reports its address, hashes it on request."""
    backend = MooncakeBackend(host="127.0.0.1")
    cache = torch.zeros(SHAPE, dtype=torch.float16)
    backend.register(cache.data_ptr(), cache.numel() * cache.element_size())
    conn.send((backend.session_id, cache.data_ptr(), cache.numel() * cache.element_size()))
    while (cmd := conn.recv()) != "quit":
        assert cmd == "sha"
        conn.send(_sha(cache))
    backend.close()
    conn.send("bye")


@pytest.fixture(scope="module")
def decode_peer():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_peer, args=(child,), daemon=True)
    proc.start()
    assert parent.poll(120), "decode peer did not start"
    yield parent, parent.recv()
    parent.send("quit")
    assert parent.poll(30) and parent.recv() == "bye"
    proc.join(30)
    assert proc.exitcode == 0


@pytest.fixture(scope="module")
def prefill():
    backend = MooncakeBackend(host="127.0.0.1")
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(SHAPE, dtype=torch.float32, generator=gen).to(torch.float16)
    backend.register(cache.data_ptr(), cache.numel() * cache.element_size())
    yield backend, cache
    backend.close()


def test_write_kv_blocks_byte_exact(decode_peer, prefill):
    conn, (peer, dst_base, _) = decode_peer
    backend, src = prefill
    assert peer.startswith("127.0.0.1:") and peer != backend.session_id
    pairs = align_regions(
        regions_for_kv_cache(src.data_ptr(), SHAPE[0], LAYERS, **GEOM),
        regions_for_kv_cache(dst_base, SHAPE[0], LAYERS, **GEOM),
    )
    src_ids = [*range(0, 48), 50, 52]
    dst_ids = [*range(10, 58), 0, 2]
    descs = DescriptorPlan(pairs).descriptors(src_ids, dst_ids)  # an int64 table, as a push writes
    assert len(descs) == 3  # one 3 MiB run across all layers, two single blocks
    backend.write(peer, descs, transfer_id="t-mooncake")

    expected = torch.zeros(SHAPE, dtype=torch.float16)
    expected[dst_ids] = src[src_ids]
    conn.send("sha")
    assert conn.poll(30) and conn.recv() == _sha(expected)


def test_errors_name_peer_and_transfer(decode_peer, prefill):
    _, (peer, dst_base, dst_bytes) = decode_peer
    backend, src = prefill
    src_addr = src.data_ptr()
    with pytest.raises(TransferError, match=r"127\.0\.0\.1:1'.*t-unknown-peer.*-1"):
        backend.write("127.0.0.1:1", [(src_addr, dst_base, 4096)], transfer_id="t-unknown-peer")
    with pytest.raises(TransferError, match="t-bad-dst") as ei:
        backend.write(peer, [(src_addr, dst_base + dst_bytes, 4096)], transfer_id="t-bad-dst")
    assert ei.value.code is not None and ei.value.code < 0 and ei.value.peer == peer
    with pytest.raises(TransferError, match="not registered") as ei:
        backend.write(peer, [(src_addr + src.numel() * 2, dst_base, 4096)], transfer_id="t-bad-src")
    assert ei.value.code is None
