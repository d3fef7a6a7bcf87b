"""The local-disk tier: one checksummed file per block under a byte budget, LRU. No torch.

File layout (little-endian):

    offset  size  field
    0       8     MAGIC
    8       16    block hash (the key; a file under another name is a miss)
    24      8     payload bytes
    32      16    blake2b-128 of the payload
    48      n     payload: the block's KV bytes as the device cache holds them

A file whose header, length or digest does not match is a miss (counted in ``num_corrupt``) and
is deleted; it never reaches a device block. Files are written by one writer thread (a temporary
name, then renamed into place); until then a read is served from the bytes waiting to be written.

The tier does not outlive the process: each engine writes into its own folder
``<disk_path>/pdserve-kv-<pid>``, created empty at start and deleted at close; folders of
processes no longer running are deleted at start.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import shutil
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

MAGIC = b"PDKVBLK1"
_HEADER = struct.Struct("<8s16sQ16s")
_DIR_PREFIX = "pdserve-kv-"


def _digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskTier:
    """Mutates its index, its folder and its counters; ``put`` returns at once."""

    def __init__(self, disk_path: str, budget_bytes: int, block_bytes: int) -> None:
        assert budget_bytes > 0 and block_bytes > 0
        self.block_bytes = block_bytes
        self.capacity_blocks = budget_bytes // (block_bytes + _HEADER.size)
        root = Path(disk_path)
        root.mkdir(parents=True, exist_ok=True)
        for old in root.glob(f"{_DIR_PREFIX}*"):
            pid = old.name[len(_DIR_PREFIX) :]
            if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        self.folder = root / f"{_DIR_PREFIX}{os.getpid()}"
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self._pending: dict[bytes, bytes] = {}  # hash -> file bytes not yet written
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.num_corrupt = 0
        self.num_write_errors = 0
        self._closed = False
        # (stored: bool, hash) for each block indexed or dropped (KVOffloadManager.set_listener)
        self.on_change: Callable[[bool, bytes], None] | None = None
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload-disk", daemon=True)
        self._writer.start()

    @property
    def used_bytes(self) -> int:
        return len(self._index) * (self.block_bytes + _HEADER.size)

    @property
    def num_pending_writes(self) -> int:
        return len(self._pending)

    def path(self, block_hash: bytes) -> Path:
        return self.folder / f"{block_hash.hex()}.kvb"

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def put(self, block_hash: bytes, payload: bytes | memoryview) -> None:
        """Keep ``payload`` under ``block_hash``, evicting the least recently used files past the budget."""
        if self.capacity_blocks < 1:
            return
        assert len(payload) == self.block_bytes
        data = _HEADER.pack(MAGIC, block_hash, len(payload), _digest(payload)) + bytes(payload)
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return
            while len(self._index) >= self.capacity_blocks:
                old, _ = self._index.popitem(last=False)
                if self._pending.pop(old, None) is None:
                    with contextlib.suppress(FileNotFoundError):
                        self.path(old).unlink()
                if self.on_change is not None:
                    self.on_change(False, old)
            self._index[block_hash] = None
            self._pending[block_hash] = data
        self._queue.put(block_hash)
        if self.on_change is not None:
            self.on_change(True, block_hash)

    def get(self, block_hash: bytes) -> memoryview | None:
        """The block's payload, checked; None when absent or corrupt (a corrupt file is deleted)."""
        with self._lock:
            if block_hash not in self._index:
                return None
            self._index.move_to_end(block_hash)
            data = self._pending.get(block_hash)
        if data is None:
            try:
                data = self.path(block_hash).read_bytes()
            except OSError:
                data = b""
        payload = self._check(block_hash, data)
        if payload is None:
            self.num_corrupt += 1
            with self._lock:
                self._index.pop(block_hash, None)
                self._pending.pop(block_hash, None)
            if self.on_change is not None:
                self.on_change(False, block_hash)
            with contextlib.suppress(FileNotFoundError):
                self.path(block_hash).unlink()
        return payload

    def _check(self, block_hash: bytes, data: bytes) -> memoryview | None:
        if len(data) < _HEADER.size:
            return None
        magic, key, n, digest = _HEADER.unpack_from(data)
        payload = memoryview(data)[_HEADER.size :]  # no copy of the block
        if magic != MAGIC or key != block_hash or n != self.block_bytes or len(payload) != n:
            return None
        return payload if _digest(payload) == digest else None

    def _write_loop(self) -> None:
        while (block_hash := self._queue.get()) is not None:
            with self._lock:
                data = self._pending.get(block_hash)
            if data is None or self._closed:  # evicted before it was written, or closing
                continue
            final = self.path(block_hash)
            tmp = final.with_suffix(".tmp")
            try:
                tmp.write_bytes(data)
                os.replace(tmp, final)
            except OSError as e:  # a full or failing disk: the block is dropped from the tier
                logger.warning("kv offload: writing %s failed: %s", final, e)
                self.num_write_errors += 1
                with self._lock:
                    self._index.pop(block_hash, None)
                    self._pending.pop(block_hash, None)
                continue
            with self._lock:
                if self._pending.get(block_hash) is data:
                    del self._pending[block_hash]
                elif block_hash not in self._index:  # evicted while being written
                    with contextlib.suppress(FileNotFoundError):
                        final.unlink()

    def close(self) -> None:
        """Stop the writer (queued writes are dropped) and delete the folder (idempotent)."""
        self._closed = True
        self._queue.put(None)
        shutil.rmtree(self.folder, ignore_errors=True)
