"""CudaIpcBackend's directory, epoch, range checks and copy plan, on host memory.

The CUDA calls go through a fake ``CudaApi`` over ctypes buffers (this module's unit tests only);
the real runtime is covered by tests/gpu/test_cuda_ipc_gpu.py on a GPU.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from pdserve.errors import ConfigError
from pdserve.kvtransfer.backend import TransferError
from pdserve.kvtransfer.connector import KVProducer
from pdserve.kvtransfer.cuda_ipc import CudaIpcBackend
from pdserve.kvtransfer.factory import make_backend
from pdserve.kvtransfer.ipc_directory import parse_session
from pdserve.kvtransfer.regions import align_regions, build_descriptors, regions_for_kv_cache

SIZE = 4096


class FakeCuda:
    """Host buffers stand in for device allocations; a handle is the base address in hex."""

    def __init__(self) -> None:
        self.allocations: dict[int, int] = {}
        self.opened: list[int] = []
        self.closed: list[int] = []
        self.copies: list[tuple[int, int, int]] = []

    def alloc(self, fill: int = 0):
        buf = ctypes.create_string_buffer(bytes([fill]) * SIZE, SIZE)
        self.allocations[ctypes.addressof(buf)] = SIZE
        return buf, ctypes.addressof(buf)

    def current_device(self) -> int:
        return 0

    def allocation_of(self, addr: int) -> tuple[int, int]:
        for base, size in self.allocations.items():
            if base <= addr < base + size:
                return base, size
        raise ValueError(f"{addr:#x} is host memory")

    def ipc_handle(self, base: int) -> bytes:
        return base.to_bytes(64, "little")

    def open_handle(self, handle: bytes, device: int) -> int:
        base = int.from_bytes(handle, "little")
        self.opened.append(base)
        return base  # one address space: the "mapping" is the allocation itself

    def close_handle(self, addr: int, device: int) -> None:
        self.closed.append(addr)

    def copy(self, copies, device: int) -> None:
        assert copies.dtype == np.int64 and copies.shape == (len(copies), 3)  # the table write() builds
        for src, dst, n in copies.tolist():
            self.copies.append((src, dst, n))
            ctypes.memmove(dst, src, n)


@pytest.fixture
def cuda():
    return FakeCuda()


@pytest.fixture
def pair(cuda):
    p, d = CudaIpcBackend(cuda=cuda), CudaIpcBackend(cuda=cuda)
    yield p, d
    p.close()
    d.close()


def test_session_names_host_port_and_epoch(pair):
    p, d = pair
    host, port, epoch = parse_session(d.session_id)
    assert host == "127.0.0.1" and port > 0 and epoch == d.epoch != p.epoch
    with pytest.raises(ValueError, match="host:port/epoch"):
        parse_session("127.0.0.1:5000")


def test_write_copies_bytes_in_own_process_without_ipc(cuda, pair):
    p, d = pair
    _src_buf, src = cuda.alloc(7)
    dst_buf, dst = cuda.alloc(0)
    p.register(src, SIZE)
    d.register(dst + 1024, 2048)  # an interior range: offset inside its allocation travels
    p.write(d.session_id, [(src + 10, dst + 1024, 100), (src, dst + 3000, 72)], transfer_id="t")
    assert dst_buf.raw[1024:1124] == b"\x07" * 100 and dst_buf.raw[3000:3072] == b"\x07" * 72
    assert dst_buf.raw[:1024] == b"\x00" * 1024 and cuda.opened == []


def test_write_takes_the_plans_int64_table_as_it_is(cuda, pair):
    """DescriptorPlan's table goes to the copy without a list in between; the caller's table
    is not shifted in place (a plan's rows may be written again)."""
    p, d = pair
    _src_buf, src = cuda.alloc(5)
    dst_buf, dst = cuda.alloc(0)
    p.register(src, SIZE)
    d.register(dst, SIZE)
    table = np.array([[src, dst + 512, 64], [src + 64, dst + 2048, 32]], dtype=np.int64)
    p.write(d.session_id, table, transfer_id="t")
    assert dst_buf.raw[512:576] == b"\x05" * 64 and dst_buf.raw[2048:2080] == b"\x05" * 32
    assert table.tolist() == [[src, dst + 512, 64], [src + 64, dst + 2048, 32]]
    assert cuda.copies == [(src, dst + 512, 64), (src + 64, dst + 2048, 32)]


def test_peer_in_another_process_is_opened_once_and_closed(cuda, pair):
    p, d = pair
    _src_buf, src = cuda.alloc(3)
    dst_buf, dst = cuda.alloc(0)
    p.register(src, SIZE)
    d.register(dst, SIZE)
    d._process = "another"  # the directory now says "another process": the IPC path is taken
    for i in range(3):
        p.write(d.session_id, [(src, dst + 64 * i, 64)], transfer_id=f"t{i}")
    assert cuda.opened == [dst] and dst_buf.raw[:192] == b"\x03" * 192
    p.close()
    assert cuda.closed == [dst]


def test_unregistered_target_or_source_is_refused_before_any_copy(cuda, pair):
    p, d = pair
    _, src = cuda.alloc(1)
    _, dst = cuda.alloc(0)
    p.register(src, SIZE)
    d.register(dst, 1024)
    with pytest.raises(TransferError, match="not registered on the peer") as e:
        p.write(d.session_id, [(src, dst, 64), (src, dst + 1000, 64)], transfer_id="t")
    assert e.value.code == -1 and cuda.copies == []
    with pytest.raises(TransferError, match=r"source .* not registered") as e:
        p.write(d.session_id, [(src + SIZE - 8, dst, 64)], transfer_id="t")
    assert e.value.code is None


def test_restarted_or_gone_peer_is_refused(cuda, pair):
    p, d = pair
    _, src = cuda.alloc(1)
    _, dst = cuda.alloc(0)
    p.register(src, SIZE)
    d.register(dst, SIZE)
    host, port, _ = parse_session(d.session_id)
    with pytest.raises(TransferError, match="peer restarted"):
        p.write(f"{host}:{port}/0123456789abcdef", [(src, dst, 8)], transfer_id="t")
    session = d.session_id
    d.close()
    with pytest.raises(TransferError, match="unreachable"):
        p.write(session, [(src, dst, 8)], transfer_id="t")
    assert cuda.copies == []


def test_host_memory_is_refused_at_register(cuda, pair):
    p, _ = pair
    buf = ctypes.create_string_buffer(64)
    with pytest.raises(TransferError, match="CUDA device memory"):
        p.register(ctypes.addressof(buf), 64)


def test_a_failed_copy_is_a_counted_failed_push(cuda, pair):
    p, d = pair
    geom = dict(block_size=4, num_kv_heads=1, head_dim=8, elem_bytes=2)  # 128 B per layer block
    layers = ["l0", "l1"]
    _, src = cuda.alloc(5)
    _, dst = cuda.alloc(0)
    p.register(src, SIZE)
    d.register(dst, SIZE)
    src_regions = regions_for_kv_cache(src, 16, layers, **geom)
    dst_regions = regions_for_kv_cache(dst, 16, layers, **geom)
    released: list[str] = []
    prod = KVProducer(p, src_regions, 4, released.append)
    prod.on_hold("t", [0, 1], need_send=1)

    def broken(copies, device):
        raise OSError("cudaMemcpyAsync failed: CUDA error 1")

    cuda.copy = broken
    res = prod.push("t", [3, 4], 8, dst_regions, d.session_id)
    assert not res.ok and "device copy failed" in res.error and prod.failures_total == 1
    assert released == ["t"]  # need_send=1 reached: the blocks are freed, not leaked
    pairs = align_regions(src_regions, dst_regions)
    assert build_descriptors(pairs, [0, 1], [3, 4])  # the plan itself was valid


def test_push_checks_the_plans_spans_against_registered_memory(cuda, pair):
    """KVProducer.push hands the plan's spans to ``write_spanned``: scattered blocks inside the
    registered half of the sender's allocation land byte for byte; a block past it is refused
    before any copy, as ``write`` refuses it from the rows."""
    p, d = pair
    geom = dict(block_size=4, num_kv_heads=1, head_dim=8, elem_bytes=2)  # 128 B per layer block
    layers = ["l0", "l1"]  # 256 B per block, 16 blocks: the whole allocation
    src_buf, src = cuda.alloc(0)
    ctypes.memmove(src, bytes(range(256)) * 16, SIZE)
    dst_buf, dst = cuda.alloc(0)
    p.register(src, SIZE // 2)  # blocks 0-7 only
    d.register(dst, SIZE)
    src_regions = regions_for_kv_cache(src, 16, layers, **geom)
    dst_regions = regions_for_kv_cache(dst, 16, layers, **geom)
    prod = KVProducer(p, src_regions, 4, lambda t: None)
    seen_spans: list[object] = []
    write_spanned = p.write_spanned

    def spy(peer, descs, spans, *, transfer_id):
        seen_spans.append(spans)
        return write_spanned(peer, descs, spans, transfer_id=transfer_id)

    p.write_spanned = spy
    prod.on_hold("ok", [1, 2, 7], need_send=1)
    res = prod.push("ok", [9, 3, 12], 12, dst_regions, d.session_id)
    assert res.ok and res.bytes == 3 * 256 and res.num_descriptors == 3
    assert seen_spans and all(s is not None for s in seen_spans)  # the plan's spans, not recomputed
    for s_b, d_b in ((1, 9), (2, 3), (7, 12)):
        assert dst_buf.raw[d_b * 256 : d_b * 256 + 256] == src_buf.raw[s_b * 256 : s_b * 256 + 256]
    assert dst_buf.raw.count(0) == SIZE - 3 * 256 + 3  # nothing else written (one 0 a block)
    prod.on_hold("past", [6, 8], need_send=1)
    copies = len(cuda.copies)
    res = prod.push("past", [0, 1], 8, dst_regions, d.session_id)
    assert not res.ok and "not registered" in res.error and len(cuda.copies) == copies
    plan = prod._plan(dst_regions, None)
    table, _ = plan.descriptors_spans([6, 8], [0, 1])
    with pytest.raises(TransferError, match=r"source .* not registered"):
        p.write(d.session_id, table, transfer_id="rows")  # the same verdict from the rows


def test_factory_refuses_cuda_ipc_on_cpu_and_unknown_transports():
    with pytest.raises(ConfigError, match=r"cuda_ipc.*'cpu'"):
        make_backend("cuda_ipc", "127.0.0.1", "cpu")
    with pytest.raises(ConfigError, match="unknown kv_transport 'nvlink'"):
        make_backend("nvlink", "127.0.0.1", "cuda")


def test_directory_is_cached_and_asked_again_for_a_new_range(cuda, monkeypatch):
    import pdserve.kvtransfer.ipc_directory as mod

    p, d = CudaIpcBackend(cuda=cuda), CudaIpcBackend(cuda=cuda)
    asks: list[int] = []
    real_ask = mod.ask_ranges
    monkeypatch.setattr(mod, "ask_ranges", lambda h, port, t: asks.append(port) or real_ask(h, port, t))
    try:
        src_buf, src = cuda.alloc(9)
        dst_buf, dst = cuda.alloc(0)
        p.register(src, SIZE)
        d.register(dst, 1024)
        for _ in range(3):
            p.write(d.session_id, [(src, dst, 16)], transfer_id="t")
        assert len(asks) == 1  # one round trip for three writes
        d.register(dst + 2048, 1024)  # registered after p cached the answer
        p.write(d.session_id, [(src, dst + 2048, 16)], transfer_id="t")
        assert len(asks) == 2 and dst_buf.raw[2048:2064] == src_buf.raw[:16] == b"\x09" * 16
    finally:
        p.close()
        d.close()


def test_mapping_of_a_restarted_peer_is_closed_and_its_old_session_refused(cuda, pair):
    p, d = pair
    _, src = cuda.alloc(4)
    dst_buf, dst = cuda.alloc(0)
    p.register(src, SIZE)
    d.register(dst, SIZE)
    d._process = "another"
    old = d.session_id
    p.write(old, [(src, dst, 32)], transfer_id="t1")
    assert cuda.opened == [dst] and cuda.closed == []
    d._epoch = "0123456789abcdef"  # the peer "restarted" on the same address
    new = f"{old.rpartition('/')[0]}/{d._epoch}"
    p.write(new, [(src, dst + 32, 32)], transfer_id="t2")
    assert cuda.closed == [dst] and cuda.opened == [dst, dst]  # old mapping closed, new one opened
    with pytest.raises(TransferError, match="peer restarted"):
        p.write(old, [(src, dst, 32)], transfer_id="t3")
    assert dst_buf.raw[:64] == b"\x04" * 64
    d.close()
    with pytest.raises(TransferError, match="unreachable"):
        p._forget_peer(new)  # as after refresh_s
        p.write(new, [(src, dst, 32)], transfer_id="t4")
    assert cuda.closed == [dst, dst]  # a peer that stopped answering is let go too


def test_own_process_is_told_apart_from_an_equal_pid_elsewhere(cuda, pair):
    p, d = pair
    _, src = cuda.alloc(2)
    _, dst = cuda.alloc(0)
    p.register(src, SIZE)
    d.register(dst, SIZE)
    d._process = f"{d._process.split('-')[0]}-{'0' * 16}"  # same pid, another pid namespace
    p.write(d.session_id, [(src, dst, 8)], transfer_id="t")
    assert cuda.opened == [dst]  # opened through IPC, not taken for our own address


def test_stale_answer_is_used_and_rechecked_off_the_write_path(cuda):
    import time

    p, d = CudaIpcBackend(cuda=cuda, refresh_s=0.0), CudaIpcBackend(cuda=cuda)
    try:
        _, src = cuda.alloc(6)
        dst_buf, dst = cuda.alloc(0)
        p.register(src, SIZE)
        d.register(dst, SIZE)
        d._process = "another"
        p.write(d.session_id, [(src, dst, 16)], transfer_id="t1")  # asks, opens
        d._epoch = "fedcba9876543210"  # restarted behind the cached answer
        p.write(d.session_id, [(src, dst + 16, 16)], transfer_id="t2")  # cached answer, no round trip
        assert dst_buf.raw[:32] == b"\x06" * 32
        deadline = time.monotonic() + 5
        while cuda.closed != [dst] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cuda.closed == [dst]  # the background ask saw the new epoch and let the mapping go
        with pytest.raises(TransferError, match="peer restarted"):
            p.write(d.session_id, [(src, dst, 16)], transfer_id="t3")
    finally:
        p.close()
        d.close()


class ShadowCuda(FakeCuda):
    """Opening a peer's handle maps its allocation at another address here (a shadow buffer),
    as CUDA IPC does: a copy lands right only if the target was moved to the mapping."""

    def __init__(self) -> None:
        super().__init__()
        self.shadows: dict[int, ctypes.Array] = {}

    def open_handle(self, handle: bytes, device: int) -> int:
        base = super().open_handle(handle, device)
        self.shadows[base] = ctypes.create_string_buffer(SIZE)
        return ctypes.addressof(self.shadows[base])


def test_targets_move_to_the_mapping_of_their_peer_range():
    cuda = ShadowCuda()
    p, d = CudaIpcBackend(cuda=cuda), CudaIpcBackend(cuda=cuda)
    try:
        _src_buf, src = cuda.alloc(5)
        peer_a_buf, peer_a = cuda.alloc(0)
        peer_b_buf, peer_b = cuda.alloc(0)
        p.register(src, SIZE)
        d.register(peer_a + 512, 2048)  # an interior range: its offset in the allocation counts
        d.register(peer_b, SIZE)
        d._process = "another"  # the IPC path: targets move to our mappings
        # one peer range holds every target (one shift), then targets in two ranges (one each)
        p.write(d.session_id, [(src + 16 * i, peer_a + 512 + 64 * i, 16) for i in range(6)], transfer_id="t1")
        p.write(d.session_id, [(src, peer_a + 2048, 48), (src, peer_b + 256, 32)], transfer_id="t2")
        a, b = cuda.shadows[peer_a].raw, cuda.shadows[peer_b].raw
        assert all(a[512 + 64 * i : 528 + 64 * i] == b"\x05" * 16 for i in range(6))
        assert a[2048:2096] == b"\x05" * 48 and b[256:288] == b"\x05" * 32
        assert a.count(5) == 6 * 16 + 48 and b.count(5) == 32  # nothing anywhere else
        assert cuda.opened == [peer_a, peer_b]  # each allocation opened once
        assert peer_a_buf.raw == peer_b_buf.raw == b"\x00" * SIZE  # nothing at the peer's addresses
    finally:
        p.close()
        d.close()
