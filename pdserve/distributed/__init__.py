"""Tensor parallelism: the process group (``parallel_state``) and the SPMD worker ranks (``tp_worker``)."""
