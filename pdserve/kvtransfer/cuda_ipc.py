"""Same-host GPU KV transport: CUDA IPC handles of the peer's KV tensor, device-to-device copies.

``kv_transport: cuda_ipc``. Each backend serves its registered ranges, their CUDA IPC handles
and this process's epoch in a tiny JSON-over-TCP directory on ``host`` (kvtransfer/ipc_directory.py:
the server, the client call, ``session_id`` = ``"host:port/epoch"``; a peer that restarted has a
new epoch and writes to its old session are refused).

A write looks the target up in the peer's directory reply, cached per session: the first write
to a session asks (and checks the epoch), a target outside the cached ranges or a failed copy
asks again; a write ``refresh_s`` after the last answer uses it and has a background thread ask
again (a loopback round trip costs ~100 us of Python and more, over the copy of a 2k-token
prompt's KV), which retires the peer if its epoch changed or it stopped answering. It opens the peer's
allocation once per (session, handle) with ``cudaIpcOpenMemHandle`` (kvtransfer/ipc_mappings.py)
and copies the descriptors (an int64 table, shifted to the mapping with numpy) on a private stream, then waits for it: when ``write`` returns the bytes are in the
peer's tensor. The descriptors are already merged block runs (``regions.DescriptorPlan``'s int64
table, taken as it is; a list of tuples is converted), so a fresh 2k-token prompt is a handful
of ``cudaMemcpyAsync``; from ``BATCHED_COPY_MIN`` descriptors
on (scattered blocks) they go as one batched copy instead (``cuda_runtime``: a Triton kernel
over the table by default). Between GPUs of one host the same copy goes over NVLink / PCIe
peer access (``cudaIpcMemLazyEnablePeerAccess``). Writes into our own process (one process
holding both ends, tests) skip the IPC open: the peer's address is ours ("our own" is a pid plus
a random token, so containers with their own pid namespaces are told apart). A mapping of a peer
that restarted (same address, new epoch) or stopped answering is closed once no write uses it.

The CUDA runtime is reached through ctypes (``cuda_runtime.CudaRuntime``); unit tests on hosts
without CUDA pass a fake runtime with the same calls.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from typing import Any

import numpy as np

from pdserve.kvtransfer import ipc_directory
from pdserve.kvtransfer.backend import TransferBackend, TransferError, _RangeSet
from pdserve.kvtransfer.cuda_runtime import BATCHED_COPY_MIN, CudaApi, CudaRuntime, copy_table
from pdserve.kvtransfer.ipc_directory import DirectoryServer, find_range, parse_session
from pdserve.kvtransfer.ipc_mappings import PeerMappings
from pdserve.kvtransfer.regions import Descriptors, Spans

__all__ = ["BATCHED_COPY_MIN", "CudaApi", "CudaIpcBackend"]

logger = logging.getLogger(__name__)
# Who "this process" is in a directory reply. A pid alone is not enough: two containers on one
# host (separate pid namespaces, both pid 1) would each take the other's addresses for their own.
_PROCESS_ID = f"{os.getpid()}-{secrets.token_hex(8)}"


def _spans(table: np.ndarray) -> tuple[int, int, int, int]:
    """[lowest start, highest end) of the sources, then of the targets (per column: an
    ``axis=0`` reduction of the [n, 2] columns costs 4x as much at 1,000 rows)."""
    if len(table) == 1:
        src, dst, n = table[0].tolist()
        return src, src + n, dst, dst + n
    src, dst, n = table.T
    return int(src.min()), int((src + n).max()), int(dst.min()), int((dst + n).max())


class CudaIpcBackend(TransferBackend):
    """Writes into a same-host peer's GPU memory through CUDA IPC (module docstring)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        cuda: CudaApi | None = None,
        timeout_s: float = 10.0,
        refresh_s: float = 5.0,
        device: int | None = None,
    ) -> None:
        """``device``: the CUDA ordinal whose context opens peers' handles and issues the copies
        (the KV cache's device); None = the current one."""
        self._cuda: CudaApi = cuda if cuda is not None else CudaRuntime()
        self._host = host
        self._timeout_s = timeout_s
        self._refresh_s = refresh_s
        self._peers: dict[str, tuple[float, dict[str, Any], list[dict[str, Any]]]] = {}  # session -> answer
        self._epoch = secrets.token_hex(8)
        self._process = _PROCESS_ID
        self._device = self._cuda.current_device() if device is None else device
        self._lock = threading.Lock()
        self._ranges = _RangeSet()
        self._handles: dict[int, dict[str, Any]] = {}  # registered addr -> advertised entry
        self._mappings = PeerMappings(self._cuda, self._device)  # peers' allocations opened here
        self._closed = False
        self._rechecking: set[str] = set()  # sessions whose directory is being asked in the background
        self._server = DirectoryServer(host, self._directory)
        self._session_id = f"{host}:{self._server.port}/{self._epoch}"

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def epoch(self) -> str:
        return self._epoch

    def _directory(self) -> dict[str, Any]:
        with self._lock:
            entries = list(self._handles.values())
        return {"epoch": self._epoch, "process": self._process, "device": self._device, "ranges": entries}

    def register(self, addr: int, length: int) -> None:
        if self._closed:
            raise TransferError(self._session_id, "-", "register", None, "backend is closed")
        try:
            base, size = self._cuda.allocation_of(addr)
            handle = self._cuda.ipc_handle(base)
        except (OSError, ValueError) as e:
            raise TransferError(
                self._session_id,
                "-",
                f"register({addr:#x}, {length})",
                None,
                f"kv_transport cuda_ipc needs the KV cache in CUDA device memory: {e}",
            ) from e
        if addr + length > base + size:
            raise TransferError(
                self._session_id,
                "-",
                f"register({addr:#x}, {length})",
                None,
                f"range ends past its allocation {base:#x}+{size}",
            )
        with self._lock:
            self._ranges.add(addr, length)
            self._handles[addr] = {
                "addr": addr,
                "length": length,
                "offset": addr - base,
                "handle": handle.hex(),
            }

    def unregister(self, addr: int) -> None:
        with self._lock:
            try:
                self._ranges.remove(addr)
            except KeyError:
                raise TransferError(
                    self._session_id, "-", f"unregister({addr:#x})", None, "not registered"
                ) from None
            del self._handles[addr]

    def _peer_ranges(
        self, peer_session: str, transfer_id: str, *, fresh: bool = False
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        now = time.monotonic()
        with self._lock:
            cached = self._peers.get(peer_session)
        if cached is not None and not fresh:
            if now - cached[0] >= self._refresh_s:
                self._recheck_later(peer_session)
            return cached[1], cached[2]
        try:
            host, port, epoch = parse_session(peer_session)
            reply = ipc_directory.ask_ranges(host, port, self._timeout_s)
        except (OSError, ValueError) as e:
            self._retire(peer_session)
            raise TransferError(
                peer_session, transfer_id, "write", None, f"peer directory unreachable: {e}"
            ) from e
        if reply.get("epoch") != epoch:
            self._retire(peer_session)
            raise TransferError(
                peer_session,
                transfer_id,
                "write",
                None,
                f"peer epoch is {reply.get('epoch')!r}, not {epoch!r}: the peer restarted and its KV is gone",
            )
        ranges = reply.get("ranges")
        if not isinstance(ranges, list):
            raise TransferError(peer_session, transfer_id, "write", None, "malformed directory reply")
        with self._lock:
            self._peers[peer_session] = (now, reply, ranges)
        # the same address under another epoch is that peer before a restart: gone for good
        address = peer_session.rpartition("/")[0]
        older = {
            k for k in self._mappings.sessions() if k != peer_session and k.rpartition("/")[0] == address
        }
        for old in older:
            self._retire(old)
        return reply, ranges

    def _recheck_later(self, peer_session: str) -> None:
        """Ask a cached peer's directory again off the write path (a loopback round trip costs
        more than a 2k-token prompt's copy): a changed epoch or a silent peer retires it, and its
        next write asks synchronously."""
        with self._lock:
            if peer_session in self._rechecking or self._closed:
                return
            self._rechecking.add(peer_session)

        def run() -> None:
            try:
                self._peer_ranges(peer_session, "directory-refresh", fresh=True)
            except TransferError as e:
                logger.info("cuda_ipc peer %s let go: %s", peer_session, e.detail)
            finally:
                with self._lock:
                    self._rechecking.discard(peer_session)

        threading.Thread(target=run, name="cuda-ipc-recheck", daemon=True).start()

    def _forget_peer(self, peer_session: str) -> None:
        """Drop the cached directory answer: the next write asks the peer again."""
        with self._lock:
            self._peers.pop(peer_session, None)

    def _retire(self, peer_session: str) -> None:
        """The peer restarted or is unreachable: forget its answer, close its mappings (now, or
        when the last write still using one ends)."""
        with self._lock:
            self._peers.pop(peer_session, None)
        self._mappings.retire(peer_session)

    def _acquire(
        self, peer_session: str, reply: dict[str, Any], entry: dict[str, Any], held: list[tuple[str, str]]
    ) -> int:
        """This process's address of the peer range's allocation base; a mapping it uses is
        appended to ``held`` (``self._mappings.release`` it after the copy)."""
        if reply.get("process") == self._process:  # our own memory: no IPC (CUDA refuses it anyway)
            return int(entry["addr"]) - int(entry["offset"])
        return self._mappings.acquire(peer_session, str(entry["handle"]), held)

    def write(self, peer_session: str, descs: Descriptors, *, transfer_id: str) -> None:
        self.write_spanned(peer_session, descs, None, transfer_id=transfer_id)

    def write_spanned(
        self, peer_session: str, descs: Descriptors, spans: Spans | None, *, transfer_id: str
    ) -> None:
        if self._closed:
            raise TransferError(peer_session, transfer_id, "write", None, "backend is closed")
        if len(descs) == 0:
            return
        table = copy_table(descs)
        lo, hi, d_lo, d_hi = _spans(table) if spans is None else spans
        with self._lock:
            # one registered range holding every source (the KV cache: the usual case) answers
            # for all descriptors at once; otherwise each is looked up
            bad = (
                None
                if self._ranges.contains(lo, hi - lo)
                else self._ranges.first_outside([(s, n) for s, _, n in table.tolist()])
            )
        if bad is not None:
            raise TransferError(
                peer_session,
                transfer_id,
                "write",
                None,
                f"source {bad[0]:#x}+{bad[1]} is not registered memory",
            )
        reply, ranges = self._peer_ranges(peer_session, transfer_id)
        whole = find_range(ranges, d_lo, d_hi - d_lo)  # one peer range holds every target
        if whole is None and any(find_range(ranges, d, n) is None for _, d, n in table.tolist()):
            reply, ranges = self._peer_ranges(peer_session, transfer_id, fresh=True)  # registered since?
            whole = find_range(ranges, d_lo, d_hi - d_lo)
        held: list[tuple[str, str]] = []
        try:
            # each target moved from the peer's address to our mapping of it: one shift per
            # peer range (the whole table at once when one range holds every target)
            shifted = table.copy()
            if whole is not None:
                base = self._acquire(peer_session, reply, whole, held)
                shifted[:, 1] += base + int(whole["offset"]) - int(whole["addr"])
            else:
                moved = np.empty(len(table), dtype=np.int64)
                shift: dict[int, int] = {}  # id(entry) -> (our address - peer's address) in that range
                for i, (_, dst, n) in enumerate(table.tolist()):
                    entry = find_range(ranges, dst, n)
                    if entry is None:
                        raise TransferError(
                            peer_session,
                            transfer_id,
                            "write",
                            -1,
                            f"target {dst:#x}+{n} is not registered on the peer",
                        )
                    delta = shift.get(id(entry))
                    if delta is None:
                        base = self._acquire(peer_session, reply, entry, held)
                        delta = shift[id(entry)] = base + int(entry["offset"]) - int(entry["addr"])
                    moved[i] = delta
                shifted[:, 1] += moved
            self._cuda.copy(shifted, self._device)
        except (OSError, KeyError, TypeError, ValueError) as e:
            self._forget_peer(peer_session)  # the next write asks the peer again
            raise TransferError(peer_session, transfer_id, "write", -1, f"device copy failed: {e}") from e
        finally:
            self._mappings.release(held)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ranges = _RangeSet()
            self._handles.clear()
        self._server.close()
        self._mappings.close_all()
