"""A node process's memory (docs/reliability.md, "Soak").

- ``resident_bytes``: how much of the CPU KV cache's mapping is in RAM
  (``pdserve:kv_cache_resident_bytes``), so a node's RSS can be split into the KV cache, which
  grows on first use up to its size, and the rest, which must stay flat under load.
- ``configure_malloc``: glibc malloc arenas capped for node processes (MALLOC_ARENA_MAX,
  default 2).
- ``PDSERVE_TRACEMALLOC_EVERY_S=N`` (debugging only, off by default; tracing slows the node):
  ``tracemalloc`` starts with the node and every N seconds the log gets the 15 source lines
  whose live Python allocations grew most since the first report, and the traced total.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import mmap
import os
import tracemalloc
from collections.abc import Mapping

import numpy as np

from pdserve.errors import ConfigError

logger = logging.getLogger(__name__)
TRACEMALLOC_ENV = "PDSERVE_TRACEMALLOC_EVERY_S"
TRACEMALLOC_FRAMES = 8


def _libc() -> ctypes.CDLL:
    name = ctypes.util.find_library("c")
    assert name is not None, "no C library found"
    return ctypes.CDLL(name, use_errno=True)


M_ARENA_MAX = -8  # glibc's malloc.h
ARENA_MAX_DEFAULT = 2


def configure_malloc(environ: Mapping[str, str]) -> int | None:
    """Cap glibc's malloc arenas for a node process (``pdserve serve``): MALLOC_ARENA_MAX from
    the environment if set (glibc applied it already; returned as is), else
    ARENA_MAX_DEFAULT through ``mallopt``. Without a cap glibc gives threads that contend for
    the heap arenas of their own (up to 8 per core) whose freed memory is rarely returned: the
    prefill node's RSS outside its KV cache climbed under load (docs/reliability.md, "Soak").
    None where the C library has no mallopt (not glibc)."""
    raw = environ.get("MALLOC_ARENA_MAX", "")
    if raw:
        if not raw.isdigit():
            raise ConfigError(f"MALLOC_ARENA_MAX={raw!r} must be a whole number of arenas (glibc's setting)")
        return int(raw)
    libc = _libc()
    if not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if libc.mallopt(M_ARENA_MAX, ARENA_MAX_DEFAULT) != 1:
        raise OSError(f"mallopt(M_ARENA_MAX, {ARENA_MAX_DEFAULT}) failed")
    return ARENA_MAX_DEFAULT


def resident_bytes(addr: int, nbytes: int) -> int:
    """Bytes of ``[addr, addr + nbytes)`` resident in RAM now (``mincore``; the range is a
    mapping of this process). The CPU KV cache is an anonymous mapping whose pages become
    resident on first touch (ModelRunner.init_kv_cache): this is the part of the node's RSS it
    makes up, which grows until every block was used once and is bounded by its size."""
    if nbytes <= 0:
        return 0
    page = mmap.PAGESIZE
    start = addr - addr % page
    length = addr + nbytes - start
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = _libc()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore({start:#x}, {length}): {os.strerror(err)}")
    return int(np.count_nonzero(np.frombuffer(bytes(vec), dtype=np.uint8) & 1)) * page


async def tracemalloc_reports(every_s: float, top: int = 15) -> None:
    """Log the allocations that grew most since the first report, every ``every_s`` seconds."""
    if not tracemalloc.is_tracing():
        tracemalloc.start(TRACEMALLOC_FRAMES)
    base = tracemalloc.take_snapshot()
    while True:
        await asyncio.sleep(every_s)
        snap = tracemalloc.take_snapshot()
        cur, peak = tracemalloc.get_traced_memory()
        lines = [f"tracemalloc: traced {cur / 2**20:.1f} MiB (peak {peak / 2**20:.1f}); growth since start:"]
        for st in snap.compare_to(base, "lineno")[:top]:
            lines.append(f"  {st.size_diff / 1024:+.1f} KiB {st.count_diff:+d} blocks {st.traceback}")
        logger.warning("\n".join(lines))


def tracemalloc_every_s() -> float | None:
    """The report period PDSERVE_TRACEMALLOC_EVERY_S asks for (None: unset, no tracing)."""
    raw = os.environ.get(TRACEMALLOC_ENV, "")
    if not raw:
        return None
    try:
        v = float(raw)
    except ValueError:
        raise ConfigError(f"{TRACEMALLOC_ENV}={raw!r} must be a number of seconds > 0") from None
    if v <= 0:
        raise ConfigError(f"{TRACEMALLOC_ENV}={raw!r} must be a number of seconds > 0")
    return v


def start_memwatch() -> list[asyncio.Task[None]]:
    """The node's memory tasks (on the running loop): the tracemalloc report if asked for."""
    tasks = []
    every_s = tracemalloc_every_s()
    if every_s is not None:
        tasks.append(asyncio.create_task(tracemalloc_reports(every_s)))
    return tasks
