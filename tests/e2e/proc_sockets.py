"""Processes of a test cluster: their descendants and memory (listening sockets: pdserve/procnet.py)."""

from __future__ import annotations

import os
from pathlib import Path

from pdserve.procnet import Listener, listeners_of

__all__ = ["Listener", "descendants", "listeners_of", "vm_rss_bytes"]


def descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process below them (a router's workers, a node's stage processes)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            parent[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = set(pids), list(pids)
    while todo:
        p = todo.pop()
        for child, ppid in parent.items():
            if ppid == p and child not in found:
                found.add(child)
                todo.append(child)
    return sorted(found)


def vm_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")
