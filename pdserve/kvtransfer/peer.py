"""What a decode node's KV consumer asks of a prefill node, without the wire.

``KVConsumer`` talks to prefill nodes through a ``PrefillPeer``: the gRPC client in
``pdserve/rpc/prefill_client.py`` on a node, a fake in unit tests. The messages here are the
wire-neutral twins of node.proto's PushKVRequest / PushKVResponse / KeepAliveResponse; the
protobuf conversion lives in ``pdserve/rpc/kv_convert.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdserve.errors import PdserveError
from pdserve.kvtransfer.handshake import HandshakeInfo
from pdserve.kvtransfer.regions import Region


@dataclass(frozen=True)
class PullRequest:
    """One decode stage asks one prefill node to write a transfer's KV into its blocks."""

    transfer_id: str
    dst_block_ids: tuple[int, ...]  # covering num_tokens positions from position 0
    num_tokens: int
    dst_regions: tuple[Region, ...]  # the asking stage's KV regions
    dst_session: str  # the asking stage's transfer-engine address
    dst_compat_hash: str
    expected_src_epoch: str  # the prefill epoch decode handshook with
    want_checksum: bool  # kv_checksum: prefill answers with a digest of the pushed blocks
    dst_pp_rank: int
    dst_tp_rank: int
    dst_pp_size: int
    dst_layer_start: int  # the asking stage's layers [start, end)
    dst_layer_end: int
    early: bool  # asked while the prompt may still be prefilled: the reply brings the first token
    dst_tp_size: int = 1  # the decode node's TP ranks (the asking rank holds 1/dst_tp_size of the KV heads)
    # The block tables of the KV groups after the first (engine/kv_group_tables.py; 0 entries:
    # blocks decode does not want); () when every layer reads dst_block_ids
    dst_group_block_ids: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class PullReply:
    ok: bool  # the transfer was written completely into the asking stage
    bytes: int
    checksum: str = ""  # hex digest of the source blocks, when asked
    first_token_ids: tuple[int, ...] = ()  # what prefill sampled


@dataclass(frozen=True)
class KeepAliveReply:
    unknown_transfer_ids: tuple[str, ...] = ()  # not held there (released, expired, other epoch)
    epoch: str = ""  # the prefill's epoch now: a change means it restarted


class PeerCallError(PdserveError):
    """A call to a prefill node failed (unreachable, refused, timed out). ``code`` is the gRPC
    status name; ``FAILED_PRECONDITION`` means the peer's epoch or layout no longer matches ours
    (``stale_peer``: handshake anew)."""

    def __init__(self, address: str, code: str, details: str) -> None:
        super().__init__(f"{code} from prefill {address}: {details}")
        self.address = address
        self.code = code
        self.details = details

    @property
    def stale_peer(self) -> bool:
        return self.code == "FAILED_PRECONDITION"


class PrefillPeer(Protocol):
    """The calls a KV consumer makes to prefill nodes; each raises ``PeerCallError`` on failure."""

    async def handshake(self, address: str, info: HandshakeInfo) -> HandshakeInfo: ...

    async def push_kv(self, address: str, request: PullRequest, timeout_s: float) -> PullReply: ...

    async def keep_alive(self, address: str, transfer_ids: list[str], timeout_s: float) -> KeepAliveReply: ...
