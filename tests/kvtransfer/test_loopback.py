from __future__ import annotations

import ctypes

import pytest

from pdserve.kvtransfer.backend import LoopbackBackend, TransferError
from pdserve.kvtransfer.regions import DescriptorPlan, align_regions, build_descriptors, regions_for_kv_cache

GEOM = dict(block_size=4, num_kv_heads=2, head_dim=8, elem_bytes=2)
LAYERS = [f"layers.{i}" for i in range(4)]
NUM_BLOCKS = 16
LAYER_BYTES = 2 * 4 * 2 * 8 * 2
CACHE_BYTES = NUM_BLOCKS * len(LAYERS) * LAYER_BYTES


def buffer(fill: bytes | None = None):
    buf = ctypes.create_string_buffer(CACHE_BYTES)
    if fill is not None:
        ctypes.memmove(buf, fill, CACHE_BYTES)
    return buf, ctypes.addressof(buf)


@pytest.fixture
def pair():
    p, d = LoopbackBackend(), LoopbackBackend()
    yield p, d
    p.close()
    d.close()


@pytest.mark.parametrize("as_table", [False, True], ids=["tuples", "int64-table"])
def test_byte_exact_copy_of_kv_blocks(pair, as_table):
    """The same bytes land from build_descriptors' tuples and from DescriptorPlan's table."""
    p, d = pair
    pattern = bytes((i * 7 + 3) % 251 for i in range(CACHE_BYTES))
    src_buf, src = buffer(pattern)
    dst_buf, dst = buffer()
    p.register(src, CACHE_BYTES)
    d.register(dst, CACHE_BYTES)
    # D stage holds layers 1..3 in its own order; P stage holds all 4.
    dst_layers = ["layers.3", "layers.1", "layers.2"]
    src_regions = regions_for_kv_cache(src, NUM_BLOCKS, LAYERS, **GEOM)
    dst_regions = regions_for_kv_cache(dst, NUM_BLOCKS, dst_layers, **GEOM)
    src_blocks, dst_blocks = [2, 3, 4, 9], [0, 1, 7, 15]
    pairs = align_regions(src_regions, dst_regions)
    if as_table:
        p.write(d.session_id, DescriptorPlan(pairs).descriptors(src_blocks, dst_blocks), transfer_id="t1")
    else:
        p.write(d.session_id, build_descriptors(pairs, src_blocks, dst_blocks), transfer_id="t1")

    got = dst_buf.raw
    expected = bytearray(CACHE_BYTES)
    d_stride = len(dst_layers) * LAYER_BYTES
    for sb, db in zip(src_blocks, dst_blocks, strict=True):
        for j, name in enumerate(dst_layers):
            i = LAYERS.index(name)
            s0 = sb * len(LAYERS) * LAYER_BYTES + i * LAYER_BYTES
            d0 = db * d_stride + j * LAYER_BYTES
            expected[d0 : d0 + LAYER_BYTES] = pattern[s0 : s0 + LAYER_BYTES]
    assert got == bytes(expected)
    del src_buf


def test_unregistered_and_unknown_peer(pair):
    p, d = pair
    src_buf, src = buffer(b"\x01" * CACHE_BYTES)
    dst_buf, dst = buffer()
    p.register(src, CACHE_BYTES)
    d.register(dst, CACHE_BYTES)
    with pytest.raises(TransferError, match="loopback:nope"):
        p.write("loopback:nope", [(src, dst, 8)], transfer_id="t")
    with pytest.raises(TransferError, match=r"target .* not registered"):
        p.write(d.session_id, [(src, dst + CACHE_BYTES - 4, 8)], transfer_id="t")
    with pytest.raises(TransferError, match=r"source .* not registered") as ei:
        p.write(d.session_id, [(src + CACHE_BYTES, dst, 8)], transfer_id="t")
    assert ei.value.code is None  # refused before any engine call, like MooncakeBackend
    p.fail_next_writes = 1
    with pytest.raises(TransferError, match="injected") as ei:
        p.write(d.session_id, [(src, dst, 8)], transfer_id="t9")
    assert ei.value.code == -1 and ei.value.transfer_id == "t9" and ei.value.peer == d.session_id
    assert dst_buf.raw == bytes(CACHE_BYTES)
    d.unregister(dst)
    with pytest.raises(TransferError):
        p.write(d.session_id, [(src, dst, 8)], transfer_id="t")
    with pytest.raises(TransferError, match="not registered"):
        d.unregister(dst)
    del src_buf


def test_overlapping_register_rejected(pair):
    p, _ = pair
    buf, addr = buffer()
    p.register(addr, 1024)
    with pytest.raises(ValueError, match="overlaps"):
        p.register(addr + 512, 1024)
    p.register(addr + 1024, 1024)
    del buf


def test_write_chunks_past_2048_descriptors(pair):
    p, d = pair
    pattern = bytes(range(256)) * (CACHE_BYTES // 256)
    src_buf, src = buffer(pattern)
    dst_buf, dst = buffer()
    p.register(src, CACHE_BYTES)
    d.register(dst, CACHE_BYTES)
    n = 3000  # every other byte: nothing merges, so two batches
    p.write(d.session_id, [(src + 2 * i, dst + 2 * i, 1) for i in range(n)], transfer_id="t")
    got = dst_buf.raw
    assert got[0 : 2 * n : 2] == pattern[0 : 2 * n : 2]
    assert got[1 : 2 * n : 2] == bytes(n)
    del src_buf
