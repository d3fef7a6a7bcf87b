"""Listening TCP sockets of processes, read from /proc (what ``ss -ltnp`` shows, without ss):
a node checks that nothing it listens on is a wildcard (pdserve/kvtransfer/bind_shim.py), and
tests list a cluster's sockets."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

TCP_LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    pid: int
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int

    @property
    def loopback(self) -> bool:
        a = self.address
        if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
            return a.ipv4_mapped.is_loopback
        return a.is_loopback

    @property
    def wildcard(self) -> bool:
        return self.address.is_unspecified


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:  # one little-endian 32-bit word
        return ipaddress.IPv4Address(raw[::-1])
    # four 32-bit words, each in host (little-endian) order
    return ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))


def listening_inodes() -> dict[int, tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """inode -> (local address, port) of every listening TCP socket in this network namespace."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == TCP_LISTEN:
                addr, port = local.split(":")
                out[inode] = (_address(addr), int(port, 16))
    return out


def listeners_of(pids: list[int | str]) -> list[Listener]:
    """Every listening TCP socket that one of ``pids`` ("self": this process) holds open."""
    inodes = listening_inodes()
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            m = re.fullmatch(r"socket:\[(\d+)\]", target)
            if m and int(m.group(1)) in inodes:
                addr, port = inodes[int(m.group(1))]
                out.append(Listener(os.getpid() if pid == "self" else int(pid), addr, port))
    return out
