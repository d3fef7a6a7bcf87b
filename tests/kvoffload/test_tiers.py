"""The offload tier's scheduler side without a model: host LRU and pins, disk checks and
budget, the manager's stores, lookups, pins and demotions. Milliseconds, no torch."""

from __future__ import annotations

import time

import pytest

from pdserve.config.kv_offload import KVOffloadConfig
from pdserve.errors import ConfigError
from pdserve.kvoffload.disk import DiskTier
from pdserve.kvoffload.host import HostTier
from pdserve.kvoffload.manager import KVOffloadManager

BB = 32  # block bytes


def _h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _manager(slots: int, disk: DiskTier | None = None, serves: bool = True) -> KVOffloadManager:
    host = HostTier(memoryview(bytearray(BB * slots)), BB, slots)
    return KVOffloadManager(host, disk, 16, host_serves_hits=serves, wait_stores=lambda: None)


def _store(mgr: KVOffloadManager, block_id: int, i: int, seq: int) -> None:
    """Evict block ``block_id`` holding hash ``i``, and play the worker: its bytes are i's."""
    mgr.on_evict(block_id, _h(i))
    spec = mgr.take_spec(seq)
    for _, slot in spec.stores:
        mgr.host.view(slot)[:] = bytes([i % 256]) * BB


def _wait_written(disk: DiskTier) -> None:
    deadline = time.monotonic() + 5
    while disk.num_pending_writes:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_store_then_lookup_pins_until_the_fence_passes() -> None:
    mgr = _manager(2)
    _store(mgr, 5, 1, seq=1)
    _store(mgr, 6, 2, seq=2)
    mgr.begin_step(2)
    hit = mgr.lookup([_h(1), _h(2), _h(3)])
    assert hit is not None and hit.num_tokens == 32 and hit.tiers == ["cpu", "cpu"]
    mgr.commit(hit, [10, 11], step_seq=3)
    # Both slots pinned by the load: a new eviction finds no slot and is dropped, never an error.
    mgr.on_evict(7, _h(3))
    assert mgr.num_dropped_blocks == 1
    assert mgr.take_spec(3).loads == list(zip([10, 11], hit.slots, strict=True))
    mgr.begin_step(3)
    _store(mgr, 7, 3, seq=4)  # the fence passed the load: the LRU entry (hash 1) makes room
    assert mgr.host.get(_h(1)) is None and mgr.host.get(_h(3)) is not None
    assert mgr.hit_tokens["cpu"] == 32


def test_cancelled_lookup_unpins() -> None:
    mgr = _manager(1)
    _store(mgr, 0, 1, seq=1)
    mgr.begin_step(1)
    hit = mgr.lookup([_h(1)])
    assert hit is not None
    mgr.cancel(hit)
    _store(mgr, 1, 2, seq=2)
    assert mgr.num_dropped_blocks == 0 and mgr.host.get(_h(2)) is not None


def test_host_eviction_moves_blocks_to_disk_and_disk_hits_are_checked(tmp_path) -> None:
    disk = DiskTier(str(tmp_path), 10 * (BB + 48), BB)
    mgr = _manager(1, disk)
    _store(mgr, 0, 1, seq=1)
    mgr.begin_step(1)
    _store(mgr, 1, 2, seq=2)  # hash 1 leaves the host tier for the disk
    assert _h(1) in disk and mgr.host.get(_h(1)) is None
    _wait_written(disk)
    mgr.begin_step(2)
    hit = mgr.lookup([_h(1)])
    assert hit is not None and hit.tiers == ["disk"]
    assert bytes(mgr.host.view(hit.slots[0])) == bytes([1]) * BB
    mgr.commit(hit, [3], step_seq=3)
    assert mgr.hit_tokens == {"cpu": 0, "disk": 16}
    disk.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "rename"])
def test_damaged_disk_file_is_a_counted_miss(damage: str, tmp_path) -> None:
    disk = DiskTier(str(tmp_path), 10 * (BB + 48), BB)
    disk.put(_h(1), bytes(range(BB)))
    disk.put(_h(2), bytes(range(BB)))
    _wait_written(disk)
    f = disk.path(_h(1))
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[60] ^= 1
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(bytes(data[:50]))
    else:  # another block's file under this name: the key in the header differs
        f.write_bytes(disk.path(_h(2)).read_bytes())
    assert disk.get(_h(1)) is None
    assert disk.num_corrupt == 1 and _h(1) not in disk and not f.exists()
    assert disk.get(_h(2)) == bytes(range(BB))
    disk.close()


def test_disk_budget_evicts_least_recently_used(tmp_path) -> None:
    disk = DiskTier(str(tmp_path), 2 * (BB + 48), BB)
    for i in range(3):
        disk.put(_h(i), bytes([i]) * BB)
    _wait_written(disk)
    assert _h(0) not in disk and disk.get(_h(2)) == bytes([2]) * BB
    assert disk.used_bytes == 2 * (BB + 48)
    assert len(list(disk.folder.glob("*.kvb"))) == 2
    disk.close()
    assert not disk.folder.exists()


def test_disk_only_stages_through_host_slots(tmp_path) -> None:
    disk = DiskTier(str(tmp_path), 10 * (BB + 48), BB)
    mgr = _manager(1, disk, serves=False)
    _store(mgr, 0, 1, seq=1)
    assert mgr.lookup([_h(1)]) is None  # staged, not on disk yet: a miss
    mgr.begin_step(1)  # the staging slot goes to disk and is free again
    assert _h(1) in disk
    _store(mgr, 1, 2, seq=2)
    assert mgr.num_dropped_blocks == 0
    mgr.begin_step(2)
    hit = mgr.lookup([_h(1), _h(2)])
    assert hit is not None and hit.tiers == ["disk"]  # one staging slot: the second is declined
    mgr.commit(hit, [4], step_seq=3)
    disk.close()


def test_stage_stores_go_to_disk_once_their_step_completed(tmp_path) -> None:
    """Pipeline stages store in their own processes: a staged slot is written to disk only
    after the step that stores it completed, not after stage 0's ``wait_stores``."""
    disk = DiskTier(str(tmp_path), 10 * (BB + 48), BB)
    host = HostTier(memoryview(bytearray(BB * 2)), BB, 2)
    mgr = KVOffloadManager(
        host, disk, 16, host_serves_hits=False, wait_stores=lambda: None, stores_complete_with_step=True
    )
    _store(mgr, 0, 1, seq=5)
    mgr.begin_step(4)  # step 5 still runs on the other stages
    assert _h(1) not in disk
    mgr.begin_step(5)
    assert _h(1) in disk
    _wait_written(disk)
    assert bytes(disk.get(_h(1)) or b"") == bytes([1]) * BB
    disk.close()


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="no tier"):
        KVOffloadConfig()
    with pytest.raises(ConfigError, match="go together"):
        KVOffloadConfig(disk_path="/tmp/x")
    with pytest.raises(ConfigError, match="unknown keys"):
        KVOffloadConfig.coerce({"cpu_gb": 1})
    assert KVOffloadConfig.coerce({"cpu_bytes": 5}) == KVOffloadConfig(cpu_bytes=5)


def test_node_settings_take_pipeline_stages_and_tp() -> None:
    from pdserve.config.node_settings import NodeConfig

    base = {"name": "p0", "role": "prefill", "model": "m", "grpc_port": 1, "metrics_port": 2}
    node = NodeConfig(**base, kv_offload={"cpu_bytes": 1 << 20})
    assert node.kv_offload_config() == KVOffloadConfig(cpu_bytes=1 << 20)
    assert NodeConfig(**base, pp=2, kv_offload={"cpu_bytes": 1 << 20}).pp == 2
    assert NodeConfig(**base, tp=2, kv_offload={"cpu_bytes": 1 << 20}).tp == 2
    with pytest.raises(ValueError, match="no tier"):
        NodeConfig(**base, kv_offload={})
    assert NodeConfig(**base).kv_offload_config() is None


def test_metrics_families(tmp_path) -> None:
    from pdserve.kvoffload.metrics import kv_offload_metrics

    disk = DiskTier(str(tmp_path), 10 * (BB + 48), BB)
    mgr = _manager(2, disk)
    _store(mgr, 0, 1, seq=1)
    mgr.begin_step(1)
    hit = mgr.lookup([_h(1)])
    assert hit is not None
    mgr.commit(hit, [2], step_seq=2)
    mgr.record_load(0.003)
    fams = {f.name: f for f in kv_offload_metrics(mgr, ["node"], ["n0"])}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert samples[("pdserve:kv_offload_stored_blocks_total", (("node", "n0"),))] == 1
    assert samples[("pdserve:kv_offload_hit_tokens_total", (("node", "n0"), ("tier", "cpu")))] == 16
    assert samples[("pdserve:kv_offload_used_bytes", (("node", "n0"), ("tier", "cpu")))] == BB
    assert samples[("pdserve:kv_offload_load_seconds_count", (("node", "n0"),))] == 1
    assert samples[("pdserve:kv_offload_load_seconds_bucket", (("le", "0.0025"), ("node", "n0")))] == 0
    assert samples[("pdserve:kv_offload_load_seconds_bucket", (("le", "0.005"), ("node", "n0")))] == 1
    disk.close()


def test_scheduler_side_imports_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import pdserve.engine.scheduler, pdserve.kvoffload.manager, pdserve.engine.kv_cache_groups, "
        "pdserve.engine.kv_group_tables; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_offload_with_tp_ranks_or_stages_is_taken() -> None:
    from pdserve.config.engine import EngineConfig, ParallelConfig

    for par in (ParallelConfig(tensor_parallel_size=2), ParallelConfig(pipeline_parallel_size=2)):
        assert EngineConfig("unused", kv_offload=KVOffloadConfig(cpu_bytes=1 << 20), parallel=par).kv_offload
