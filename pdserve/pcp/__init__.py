"""Prefill context parallelism (``pcp: N``): N rank processes split a long prompt's prefill.

index_map.py (each rank's view of the global step: zig-zag segments, token rows, who owns a row,
where a sampled row lives; no torch), exchange.py (the group, the per-layer all-gather of the
split tokens' K/V, the gather of the sampled rows), step.py (one rank's forward of a step:
``ModelRunner.launch`` calls it), runner.py (rank 0's runner and each rank's), worker.py (the
worker ranks' processes), checks.py (what is refused at start).
"""
