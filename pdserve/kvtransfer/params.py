"""Typed KV-transfer metadata: what travels from the services through the engine to the
scheduler and back out (docs/design.md §7), instead of a dict read by key in several files.

    prefill node: RemoteDecodeParams  - this request's KV is consumed by a decode node: hold it
    decode node:  RemotePrefillParams - this request's prompt KV comes from a prefill node: pull it

The scheduler-side half of the connector reads only these (``Scheduler``: how many tokens come
from a peer, hold or free at finish); the worker-side half is ``KVProducer`` / ``KVConsumer``.
No torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RemoteDecodeParams:
    """Prefill side: after prefill, hold the blocks for ``need_send`` pulls per prefill stage."""

    transfer_id: str
    need_send: int = 1
    final_at_prefill: bool = False  # max_tokens == 1: nobody pulls; the output ends here

    def __post_init__(self) -> None:
        assert self.transfer_id and self.need_send >= 1, self


@dataclass(frozen=True)
class RemotePrefillParams:
    """Decode side: the prompt's KV is pulled from ``prefill_address`` before the request runs."""

    transfer_id: str
    prefill_address: str

    def __post_init__(self) -> None:
        assert self.transfer_id and self.prefill_address, self


KVTransferParams = RemoteDecodeParams | RemotePrefillParams


@dataclass
class KVLoadSpec:
    """Remote KV a decode node must pull before the request can run."""

    request_id: str
    block_ids: list[int]  # destination blocks, covering num_tokens positions from position 0
    num_tokens: int
    params: RemotePrefillParams  # the request's (peer address, transfer_id)
    # destination tables of the KV groups after the first (engine/kv_group_tables.py), as long
    # as block_ids; NULL (0) entries are blocks before the group's window, not pulled
    group_block_ids: tuple[tuple[int, ...], ...] = ()
