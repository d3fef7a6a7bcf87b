"""KV transfer between prefill and decode (docs/design.md §3).

regions       Region, alignment by (layer_name, occurrence)                       (pure Python)
descriptors   DescriptorPlan: block ids -> merged int64 descriptor table, batches  (numpy)
backend       TransferBackend seam: MooncakeBackend (real), LoopbackBackend (unit tests)
send_tracker  prefill-side completion counting and leases                          (pure Python)
handshake     compatibility hash, epoch, field-by-field check                      (pure Python)
connector     KVProducer: prefill holds and pushes (producer_transfer: one Prefill call's transfer;
              producer_group: the node's stages answering a pull)
consumer      KVConsumer: decode pulls (pull_record, keepalive, peer: its records, leases, calls)
topology      who asks whom across PP stages and TP ranks, need_send, TP head ranges (pure Python)
head_slices   descriptors between TP ranks holding different KV heads              (pure Python)
staging       Stager: a sender packs a decode rank's heads into a registered buffer
"""

from __future__ import annotations

from pdserve.kvtransfer.backend import LoopbackBackend, MooncakeBackend, TransferBackend, TransferError
from pdserve.kvtransfer.handshake import HandshakeError, HandshakeInfo, check_compat, compat_hash, new_epoch
from pdserve.kvtransfer.regions import (
    MAX_DESCRIPTORS_PER_BATCH,
    BlockIdError,
    Descriptor,
    Descriptors,
    DescriptorTable,
    Region,
    RegionMismatchError,
    align_regions,
    build_descriptors,
    check_block_ids,
    regions_for_kv_cache,
    split_batches,
)
from pdserve.kvtransfer.send_tracker import KVSendTracker, SendEntry, UnknownTransferError

__all__ = [
    "MAX_DESCRIPTORS_PER_BATCH",
    "BlockIdError",
    "Descriptor",
    "DescriptorTable",
    "Descriptors",
    "HandshakeError",
    "HandshakeInfo",
    "KVSendTracker",
    "LoopbackBackend",
    "MooncakeBackend",
    "Region",
    "RegionMismatchError",
    "SendEntry",
    "TransferBackend",
    "TransferError",
    "UnknownTransferError",
    "align_regions",
    "build_descriptors",
    "check_block_ids",
    "check_compat",
    "compat_hash",
    "new_epoch",
    "regions_for_kv_cache",
    "split_batches",
]
