"""KV offload: blocks the prefix cache evicts are kept in host memory and on local disk.

scheduler side (ints, ids, bytes; no torch)       worker side (torch)
manager.KVOffloadManager                          copier.KVOffloadCopier
  on_evict(block_id, hash) -> a store              stores: device block -> host slot
  lookup(hashes) -> pinned host slots              loads:  host slot -> device block
  take_spec(step_seq) -> KVOffloadSpec  ------->   execute(spec) before the step's forward
host.HostTier: slots of a preallocated (pinned on CUDA) pool, LRU, pins
disk.DiskTier: one checksummed file per block, LRU, a writer thread
stages.py / shared_pool.py (pp or tp > 1): one host pool shared by the stage or rank processes,
  a row per slot, each process copying its own layers' / heads' columns
"""
