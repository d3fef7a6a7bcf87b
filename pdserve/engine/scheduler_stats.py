"""SchedulerStats: a node's queue and KV cache counters at one moment (``Scheduler.stats``),
read by its metrics (``services/node_metrics.py``), its load reports and its drain. No torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int  # the waiting queue (not those waiting for remote KV or a grammar)
    num_waiting_for_remote_kv: int
    num_held_for_transfer: int  # prefill side: finished, blocks kept for a decode node's pull
    kv_usage: float  # used / all blocks of the pool, 0..1
    prefix_hit_rate: float  # hit / looked-up blocks since start, 0..1
    num_preemptions_total: int
