"""Peers' allocations mapped into this process by ``cudaIpcOpenMemHandle``, for
``CudaIpcBackend`` (kvtransfer/cuda_ipc.py): one open per (session, handle), counted while
writes use it.

A mapping of a peer that restarted (same address, new epoch) or stopped answering is retired,
and closed once no write uses it: an open mapping would keep a dead decode's whole KV cache
allocated.
"""

from __future__ import annotations

import threading
from typing import Any

from pdserve.kvtransfer.cuda_runtime import CudaApi


class PeerMappings:
    """(session, handle hex) -> [mapped base here, writes using it now, retired]. Thread-safe."""

    def __init__(self, cuda: CudaApi, device: int) -> None:
        self._cuda = cuda
        self._device = device
        self._lock = threading.Lock()
        self._opened: dict[tuple[str, str], list[Any]] = {}

    def sessions(self) -> set[str]:
        """The sessions with a mapping open now."""
        with self._lock:
            return {k[0] for k in self._opened}

    def acquire(self, peer_session: str, handle_hex: str, held: list[tuple[str, str]]) -> int:
        """This process's address of the allocation behind ``handle_hex``, opened on its first
        use; the mapping is appended to ``held`` (``release`` it after the copy). OSError for a
        retired mapping still in use by another write (not ours to reuse) or a failed open."""
        key = (peer_session, handle_hex)
        with self._lock:  # one open per (session, handle), also with concurrent first writes
            m = self._opened.get(key)
            if m is None or m[2]:
                if m is not None:  # retired, still in use by another write: not ours to reuse
                    raise OSError(f"peer session {peer_session} was retired (restarted or unreachable)")
                base = self._cuda.open_handle(bytes.fromhex(handle_hex), self._device)
                m = self._opened[key] = [base, 0, False]
            m[1] += 1
            held.append(key)
            return int(m[0])

    def release(self, held: list[tuple[str, str]]) -> None:
        to_close: list[int] = []
        with self._lock:
            for key in held:
                m = self._opened.get(key)
                if m is None:
                    continue
                m[1] -= 1
                if m[2] and m[1] == 0:
                    to_close.append(self._opened.pop(key)[0])
        self._close(to_close)

    def retire(self, peer_session: str) -> None:
        """The peer restarted or is unreachable: close its mappings now, or when the last write
        still using one ends."""
        to_close: list[int] = []
        with self._lock:
            for key in [k for k in self._opened if k[0] == peer_session]:
                m = self._opened[key]
                m[2] = True
                if m[1] == 0:
                    to_close.append(self._opened.pop(key)[0])
        self._close(to_close)

    def close_all(self) -> None:
        with self._lock:
            opened, self._opened = self._opened, {}
        self._close([m[0] for m in opened.values()])

    def _close(self, bases: list[int]) -> None:
        for base in bases:
            try:
                self._cuda.close_handle(base, self._device)
            except OSError:  # the peer may be gone first; the driver reclaims the mapping at exit
                continue
