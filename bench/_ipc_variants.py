"""bench/gpu_ipc.py's second part: every copy method on scattered blocks, device time and host time apart.

For each case (n blocks of one size, random slots on both sides: the sender's tensor and the
receiver's KV opened through CUDA IPC) and each method it measures
- ``kernel ms``: GPU time between two events around the device work alone (a Triton kernel over
  a table already on the device; the memcpy calls; torch's copy), enqueued while a sleep kernel
  holds the stream, so host gaps do not count. Median of ``reps``.
- ``host ms``: wall clock of the whole enqueue (table built, staged and launched, or the memcpy
  calls), with the stream held by the sleep: the host path alone. ``launch ms``: the same for the
  Triton launch alone (the table already staged); ``stage ms``: for the table's staging alone
  (rows built, copied to the pinned buffer, the host-to-device copy enqueued).
- ``wall ms``: ``CudaRuntime.copy`` (the transport's call: lock, table, enqueue, stream wait) by
  wall clock; for the reference, torch's copy plus a synchronize.
and checks that every destination slot holds its source's bytes afterwards.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from triton.compiler.errors import CompilationError

from pdserve.kernels import triton_copy
from pdserve.kvtransfer.cuda_runtime import CudaRuntime

CASES = [(125, 512 << 10), (1000, 64 << 10), (16, 4 << 20)]  # (blocks, bytes each)


class _Raw:
    """A device address range as a torch uint8 tensor (through __cuda_array_interface__)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 3,
        }


class Timer:
    def __init__(self, reps: int) -> None:
        self.reps = reps
        self.cycles = 2_000_000  # each call's first hold (~1 ms); grown where the host outlasts it
        self.ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]

    def held(self, enqueue: Callable[[], Any], stream: torch.cuda.Stream) -> tuple[float, float]:
        """(device ms, host ms) medians: ``enqueue`` behind a sleep kernel that outlasts its host
        time (checked per repetition: the sleep's own events against the host clock)."""
        start, a, b = self.ev
        cycles = self.cycles
        for _ in range(4):
            dev, host, short = [], [], 0.0
            for _ in range(self.reps):
                with torch.cuda.stream(stream):
                    th = time.perf_counter()
                    start.record(stream)
                    torch.cuda._sleep(cycles)
                    a.record(stream)
                    t0 = time.perf_counter()
                    enqueue()
                    t1 = time.perf_counter()
                    b.record(stream)
                b.synchronize()
                dev.append(a.elapsed_time(b))
                host.append((t1 - t0) * 1e3)
                # the GPU ran the work only after the host had enqueued all of it?
                short = max(short, ((t1 - th) * 1e3 + 0.05) / max(start.elapsed_time(a), 1e-3))
            if short <= 1.0:
                break
            cycles = int(cycles * short * 1.5)  # the host outlasted the hold: again, longer
        return statistics.median(dev), statistics.median(host)

    def wall(self, fn: Callable[[], Any]) -> float:
        for _ in range(3):
            fn()
        ts = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)


def _v4(kernel: Any) -> int | None:
    """128-bit global loads in the compiled kernel's PTX (None where Triton gives no PTX)."""
    ptx = getattr(kernel, "asm", {}).get("ptx") if kernel is not None else None
    return len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx)) if ptx else None


def run_case(
    rt: CudaRuntime,
    timer: Timer,
    src: torch.Tensor,
    peer_addr: int,
    peer_bytes: int,
    blocks: int,
    size: int,
    deadline: float,
) -> list[dict[str, Any]]:
    dev = src.device
    g = torch.Generator().manual_seed(blocks)
    slots = min(src.numel(), peer_bytes) // size
    src_idx = torch.randperm(slots, generator=g)[:blocks]
    dst_idx = torch.randperm(slots, generator=g)[:blocks]
    table = np.stack(
        [
            src.data_ptr() + src_idx.numpy().astype(np.int64) * size,
            peer_addr + dst_idx.numpy().astype(np.int64) * size,
            np.full(blocks, size, dtype=np.int64),
        ],
        1,
    )
    peer = torch.as_tensor(_Raw(peer_addr, slots * size), device=dev).view(slots, size)
    src2d = src[: slots * size].view(slots, size)
    dst_i, src_i = dst_idx.to(dev), src_idx.to(dev)
    nbytes = blocks * size
    case = f"{blocks} x {size >> 10} KiB"
    stream = torch.cuda.Stream()

    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    ref_dev, ref_host = timer.held(lambda a=a, b=b: b.copy_(a), stream)
    ref_wall = timer.wall(lambda a=a, b=b: (b.copy_(a), torch.cuda.synchronize()))
    rows = [
        dict(
            case=case,
            variant="torch copy, same bytes, contiguous",
            kernel_ms=ref_dev,
            host_ms=ref_host,
            wall_ms=ref_wall,
            ok=True,
        )
    ]
    del a, b

    # the kernels that read their table over the bus last: a fault there would end the run
    variants = triton_copy.VARIANTS.values()
    methods = [f"triton:{v.name}" for v in variants if v.table == "device"] + ["memcpy_batch", "memcpy"]
    methods += [f"triton:{v.name}" for v in variants if v.table == "pinned"]
    for method in methods:
        row: dict[str, Any] = dict(case=case, variant=method)
        rows.append(row)
        if time.monotonic() > deadline:
            row["skipped"] = "time budget"
            continue
        rt.unavailable.pop("triton", None)  # one variant that failed to build says nothing of this one
        peer[dst_i] = 0  # what lands is checked below
        torch.cuda.synchronize()
        try:
            if method.startswith("triton:"):
                name = method.partition(":")[2]
                with torch.cuda.stream(stream):
                    staged = triton_copy.stage(table, dev, stream, triton_copy.VARIANTS[name])
                    assert staged is not None
                    row["ptx_v4_loads"] = _v4(triton_copy.launch(staged))  # compiles on first use
                stream.synchronize()
                row["kernel_ms"], row["launch_host_ms"] = timer.held(
                    lambda s=staged: triton_copy.launch(s), stream
                )
                # the table alone: built (kernel_rows), copied to the pinned buffer, its H2D copy enqueued
                _, row["stage_host_ms"] = timer.held(
                    lambda n=name: triton_copy.stage(table, dev, stream, triton_copy.VARIANTS[n]), stream
                )
                _, row["host_ms"] = timer.held(
                    lambda n=name: triton_copy.batched_copy(table, dev, stream, n), stream
                )
                row["programs"] = int(np.prod(staged.grid))
            elif method == "memcpy_batch":
                row["kernel_ms"], row["host_ms"] = timer.held(
                    lambda: rt.memcpy_batch_async(table, stream.cuda_stream), stream
                )
            else:
                row["kernel_ms"], row["host_ms"] = timer.held(
                    lambda: rt.memcpy_async(table, stream.cuda_stream), stream
                )
            rt.copy_method = method
            row["wall_ms"] = timer.wall(lambda: rt.copy(table, dev.index or 0))
            kind = method.partition(":")[0]
            if kind in rt.unavailable:  # the transport's copy ran the next method instead
                row["fell_back"] = rt.unavailable[kind]
        except (OSError, RuntimeError, ValueError, CompilationError) as e:  # lacking here; failed launch
            row["skipped"] = f"{type(e).__name__}: {e}"
            continue
        torch.cuda.synchronize()
        row["ok"] = bool(torch.equal(peer[dst_i], src2d[src_i]))
    for row in rows:
        if "kernel_ms" in row:
            row["bytes"] = nbytes
            row["GBps_kernel"] = nbytes / row["kernel_ms"] / 1e6
            row["of_copy_kernel"] = ref_dev / row["kernel_ms"]
        if "wall_ms" in row:
            row["GBps_wall"] = nbytes / row["wall_ms"] / 1e6
            row["of_copy_wall"] = ref_wall / row["wall_ms"]
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| case | method | kernel ms | host ms | stage ms | launch ms | wall ms | GB/s kernel | GB/s wall | "
        "of copy (kernel) | of copy (wall) | programs | v4 loads | bytes ok |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['case']} | {r['variant']} | skipped: {r['skipped']} |")
            continue

        def f(k: str, fmt: str = ".3f", r: dict[str, Any] = r) -> str:
            return format(r[k], fmt) if r.get(k) is not None else "-"

        print(
            f"| {r['case']} | {r['variant']} | {f('kernel_ms')} | {f('host_ms')} | {f('stage_host_ms')} | "
            f"{f('launch_host_ms')} | "
            f"{f('wall_ms')} | "
            f"{f('GBps_kernel', ',.0f')} | {f('GBps_wall', ',.0f')} | {f('of_copy_kernel', '.2f')} | "
            f"{f('of_copy_wall', '.2f')} | {r.get('programs', '-')} | {r.get('ptx_v4_loads', '-')} | "
            f"{r.get('ok', '-')}{' (fell back: ' + str(r['fell_back']) + ')' if r.get('fell_back') else ''} |"
        )
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [
            r
            for r in rows
            if r["case"] == case and "wall_ms" in r and r.get("ok") and "torch" not in r["variant"]
        ]
        if mine:
            best_w = min(mine, key=lambda r: r["wall_ms"])
            best_k = min((r for r in mine if "kernel_ms" in r), key=lambda r: r["kernel_ms"])
            print(
                f"{case}: fastest by wall {best_w['variant']} ({best_w['wall_ms']:.3f} ms, "
                f"{best_w['of_copy_wall']:.2f} of the copy); by kernel {best_k['variant']} "
                f"({best_k['kernel_ms']:.3f} ms, {best_k['of_copy_kernel']:.2f})"
            )
