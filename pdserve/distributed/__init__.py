"""Parallelism beneath the engine: the TP group (``parallel_state``), worker processes and their
pipes (``workers``), the node's view of a pipeline (``pp_stage``). Imports nothing of the engine."""
