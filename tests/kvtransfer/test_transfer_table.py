"""A producer's transfer record (kvtransfer/transfer_table.py): what a hold stores lives and dies
with the record."""

from __future__ import annotations

from pdserve.kvtransfer.send_tracker import KVSendTracker
from pdserve.kvtransfer.transfer_table import TransferTable


def test_a_holds_first_tokens_and_group_tables_go_with_forget() -> None:
    tracker = KVSendTracker(lambda _tid, _ids: None)
    table = TransferTable(tracker)
    table.admit("t")
    groups = [[7, 8], [9]]  # the engine's views: the record keeps its own copy
    table.hold("t", lambda: tracker.add("t", [1, 2, 3], 1), [42], groups)
    groups[0].append(10)
    assert table.group_block_ids("t") == ((7, 8), (9,))
    assert table.first_token_ids("t") == [42] and table.expected("t").is_set()
    table.forget("t")
    assert table.group_block_ids("t") == () and table.first_token_ids("t") == []
    assert table.ended("t") and len(table) == 0
    table.hold("u", lambda: tracker.add("u", [4], 1), [5])  # a model without per-group tables
    assert table.group_block_ids("u") == ()
