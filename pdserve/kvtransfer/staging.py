"""A sender's head gather: its KV heads that a decode TP rank holds, packed in that rank's layout.

When the prefill rank holds every KV head the asking decode rank holds and more (prefill TP 1 ->
decode TP 2: rank d holds heads ``[d * H/2, (d + 1) * H/2)``), the rank's head slice of each
token row is a strided piece of the sender's block. Instead of one descriptor per row
(``head_slices.HeadSlicePlan``: ``2 * block_size`` per block and layer), the sender copies

    cache[src_blocks][:, layers, :, :, heads, :]  ->  a registered staging buffer

(one torch gather, ``[n, L_sent, 2, block_size, H_decode, head_dim]``: exactly the decode rank's
blocks) and writes whole runs of it, as between equal layouts. ``head_slices.GatherPlan`` computes the
descriptors relative to the staging buffer's start; ``Stager`` (in the process that owns the KV
tensor: the node's, or a stage's or TP rank's worker) gathers, adds the buffer's address and
writes. A stager serialises its pushes (one buffer, grown on demand and registered anew).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from pdserve.kvtransfer.backend import TransferBackend
from pdserve.kvtransfer.head_slices import HeadGather
from pdserve.kvtransfer.regions import Descriptors, descriptor_table


class Stager:
    """Gathers from ``cache`` (``[num_blocks, L, 2, block_size, H_local, head_dim]``) into a
    staging buffer registered with ``backend`` and writes it to a peer."""

    def __init__(self, backend: TransferBackend, cache: torch.Tensor) -> None:
        self.backend = backend
        self.cache = cache
        self._lock = threading.Lock()
        self._buf: torch.Tensor | None = None

    def _buffer(self, nbytes: int) -> torch.Tensor:
        buf = self._buf
        if buf is None or buf.numel() < nbytes:
            if buf is not None:
                self.backend.unregister(buf.data_ptr())
            buf = torch.empty(max(nbytes, 2 * (buf.numel() if buf is not None else 0)), dtype=torch.uint8)
            buf = buf.to(self.cache.device)
            self.backend.register(buf.data_ptr(), buf.numel())
            self._buf = buf
        return buf

    def write_gathered(
        self, peer_session: str, gather: HeadGather, descs: Descriptors, *, transfer_id: str
    ) -> None:
        """Pack ``gather`` and write ``descs`` (relative to the packed bytes) to ``peer_session``."""
        c = self.cache
        view = c[:, slice(*gather.layers), :, :, slice(*gather.heads), :]
        shape = (len(gather.block_ids), *view.shape[1:])
        nbytes = c.element_size() * len(gather.block_ids) * view[0].numel()
        with self._lock:
            buf = self._buffer(nbytes)
            out = buf[:nbytes].view(c.dtype).view(shape)
            # one strided copy per run of consecutive blocks (index_select of a strided view
            # measured several times slower on CPU)
            for i, start, n in _runs(gather.block_ids):
                out[i : i + n].copy_(view[start : start + n])
            if c.device.type == "cuda":
                torch.cuda.synchronize(c.device)
            table = descriptor_table(descs).copy()
            table[:, 0] += buf.data_ptr()
            self.backend.write(peer_session, table, transfer_id=transfer_id)

    def close(self) -> None:
        with self._lock:
            if self._buf is not None:
                self.backend.unregister(self._buf.data_ptr())
                self._buf = None


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position, first block id, length) of each run of consecutive ids."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if out and out[-1][1] + out[-1][2] == b:
            pos, start, n = out[-1]
            out[-1] = (pos, start, n + 1)
        else:
            out.append((i, b, 1))
    return out
