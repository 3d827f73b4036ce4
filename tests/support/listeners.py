"""The TCP sockets a process tree listens on, read from /proc (Linux; no psutil): what
`ss -ltnp` shows, for the tests that pin where our servers listen."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

LISTEN = "0A"  # the TCP state in /proc/net/tcp*


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    pid: int
    command: str

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"LISTEN {host}:{self.port}  pid={self.pid} {self.command}"


def _address(hex_addr: str, family: int) -> str:
    raw = bytes.fromhex(hex_addr)
    # The kernel prints each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, raw)


def _listening_inodes() -> dict[int, tuple[str, int]]:
    out = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/net/{name}") as fh:
                rows = fh.readlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] != LISTEN:
                continue
            addr, port = fields[1].split(":")
            out[int(fields[9])] = (_address(addr, family), int(port, 16))
    return out


def process_tree(root: int) -> set[int]:
    """`root` and every process descended from it."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, added = {root}, True
    while added:
        new = {pid for pid, ppid in parents.items() if ppid in tree and pid not in tree}
        tree |= new
        added = bool(new)
    return tree


def _command(pid: int) -> str:
    """The process's argv, short: the executable's name, no `-c` program text."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    words = [os.path.basename(argv[0])]
    skip = False
    for arg in argv[1:]:
        if not skip and arg != "-c":
            words.append(arg)
        skip = arg == "-c"
    return " ".join(words)[:100]


def listeners(pids: set[int]) -> list[Listener]:
    """Every listening TCP socket (IPv4 and IPv6) held open by one of `pids`."""
    inodes = _listening_inodes()
    found = {}
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
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in inodes and inode not in found:
                    found[inode] = Listener(*inodes[inode], pid, _command(pid))
    return sorted(found.values(), key=lambda item: (item.port, item.pid))
