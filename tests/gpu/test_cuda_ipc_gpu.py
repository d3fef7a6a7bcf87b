"""The cuda_ipc KV transport between two processes on one GPU (real CUDA IPC, real copies).

The peer is a child process holding a decode-shaped KV tensor; the test writes into it through
CudaIpcBackend and asks the child for a digest of what landed. Skips cleanly without CUDA.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kvtransfer.backend import TransferError
from pdserve.kvtransfer.connector import KVProducer
from pdserve.kvtransfer.regions import regions_for_kv_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ROOT = Path(__file__).resolve().parents[2]
LAYERS = [f"model.layers.{i}.self_attn" for i in range(4)]
GEOM = dict(block_size=16, num_kv_heads=2, head_dim=64, elem_bytes=2)
NUM_BLOCKS = 32
SHAPE = (NUM_BLOCKS, len(LAYERS), 2, 16, 2, 64)

PEER = """
import hashlib, sys, torch
from pdserve.kvtransfer.cuda_ipc import CudaIpcBackend
kv = torch.zeros({shape}, dtype=torch.bfloat16, device="cuda")
b = CudaIpcBackend()
b.register(kv.data_ptr(), kv.numel() * kv.element_size())
print(b.session_id, kv.data_ptr(), flush=True)
for line in sys.stdin:
    if line.strip() == "digest":
        torch.cuda.synchronize()
        print(hashlib.sha256(kv.view(torch.uint8).cpu().numpy().tobytes()).hexdigest(), flush=True)
    else:
        break
b.close()
"""


class Peer:
    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PEER.format(shape=SHAPE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        session, addr = self.proc.stdout.readline().split()
        self.session, self.addr = session, int(addr)
        self.regions = regions_for_kv_cache(self.addr, NUM_BLOCKS, LAYERS, **GEOM)

    def digest(self) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("digest\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)


def digest_of(t: torch.Tensor) -> str:
    torch.cuda.synchronize()
    return hashlib.sha256(t.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


@pytest.fixture
def sender():
    from pdserve.kvtransfer.cuda_ipc import CudaIpcBackend

    kv = torch.randn(SHAPE, dtype=torch.bfloat16, device="cuda")
    b = CudaIpcBackend()
    b.register(kv.data_ptr(), kv.numel() * kv.element_size())
    yield b, kv
    b.close()


@pytest.fixture
def peer():
    p = Peer()
    yield p
    p.stop()


def test_push_lands_byte_exact_in_the_peer_process(sender, peer):
    backend, kv = sender
    src_regions = regions_for_kv_cache(kv.data_ptr(), NUM_BLOCKS, LAYERS, **GEOM)
    prod = KVProducer(backend, src_regions, 16, lambda tid: None)
    src_blocks, dst_blocks = [3, 4, 5, 9, 20], [7, 8, 9, 0, 31]  # runs and scattered blocks
    prod.on_hold("t1", src_blocks, need_send=1)
    res = prod.push("t1", dst_blocks, 16 * 5, peer.regions, peer.session)
    assert res.ok, res.error
    expect = torch.zeros_like(kv)
    expect[dst_blocks] = kv[src_blocks]
    assert peer.digest() == digest_of(expect)
    assert res.bytes == 5 * len(LAYERS) * 2 * 16 * 2 * 64 * 2 and res.num_descriptors == 3


def test_failed_write_moves_nothing_and_is_reported(sender, peer):
    backend, kv = sender
    before = peer.digest()
    end = peer.addr + kv.numel() * kv.element_size()
    with pytest.raises(TransferError, match="not registered on the peer"):
        backend.write(peer.session, [(kv.data_ptr(), end - 512, 1024)], transfer_id="t2")
    src_regions = regions_for_kv_cache(kv.data_ptr(), NUM_BLOCKS, LAYERS, **GEOM)
    prod = KVProducer(backend, src_regions, 16, lambda tid: None)
    prod.on_hold("t3", [1], need_send=1)
    bad_regions = regions_for_kv_cache(peer.addr + 4096, NUM_BLOCKS, LAYERS, **GEOM)  # runs past the end
    res = prod.push("t3", [NUM_BLOCKS - 1], 16, bad_regions, peer.session)
    assert not res.ok and prod.failures_total == 1
    assert peer.digest() == before


def test_restarted_peer_is_refused_by_epoch(sender):
    backend, kv = sender
    first = Peer()
    backend.write(first.session, [(kv.data_ptr(), first.addr, 4096)], transfer_id="t4")
    old_epoch = first.session.rsplit("/", 1)[1]
    first.stop()
    with pytest.raises(TransferError, match="unreachable"):
        backend._forget_peer(first.session)  # past refresh_s: the next write asks the directory
        backend.write(first.session, [(kv.data_ptr(), first.addr, 4096)], transfer_id="t5")
    second = Peer()
    try:
        addr = second.session.rsplit("/", 1)[0]
        with pytest.raises(TransferError, match="peer restarted"):
            backend.write(f"{addr}/{old_epoch}", [(kv.data_ptr(), second.addr, 4096)], transfer_id="t6")
        assert second.digest() == digest_of(torch.zeros_like(kv))
        backend.write(second.session, [(kv.data_ptr(), second.addr, 4096)], transfer_id="t7")
        expect = torch.zeros_like(kv).view(torch.uint8).view(-1)
        expect[:4096] = kv.view(torch.uint8).view(-1)[:4096]
        assert second.digest() == digest_of(expect)
    finally:
        second.stop()


def test_scattered_blocks_go_as_one_batched_copy_and_land_byte_exact(sender, peer, monkeypatch):
    from pdserve.kernels import triton_copy
    from pdserve.kvtransfer import cuda_ipc

    launches = []
    real = triton_copy.batched_copy
    monkeypatch.setattr(triton_copy, "batched_copy", lambda c, *a: (launches.append(len(c)), real(c, *a)))
    backend, kv = sender
    src_regions = regions_for_kv_cache(kv.data_ptr(), NUM_BLOCKS, LAYERS, **GEOM)
    prod = KVProducer(backend, src_regions, 16, lambda tid: None)
    src_blocks = [30, 2, 17, 5, 11, 23, 8, 26, 14, 0]  # no two consecutive on either side
    dst_blocks = [1, 29, 4, 19, 7, 12, 25, 9, 31, 15]
    prod.on_hold("t8", src_blocks, need_send=1)
    res = prod.push("t8", dst_blocks, 16 * len(src_blocks), peer.regions, peer.session)
    assert res.ok, res.error
    assert res.num_descriptors == len(src_blocks) >= cuda_ipc.BATCHED_COPY_MIN
    assert launches == [len(src_blocks)], getattr(backend._cuda, "unavailable", None)
    expect = torch.zeros_like(kv)
    expect[dst_blocks] = kv[src_blocks]
    assert peer.digest() == digest_of(expect)
