"""Which process is at the other end of a loopback connection: the proof that an activity report's pid is
the reporting process's own, before a sidecar ever signals that pid (--hang-dump-stacks).

The kernel's socket table (/proc/net/tcp, /proc/net/tcp6) gives the inode of the socket bound to the
client's address; the claimed pid owns the connection when one of /proc/PID/fd links to that socket. Only
a process in this sidecar's network and PID namespaces (its pod: the chart shares the pod's process
namespace) and readable by its user can be proven so; any other pid is never signalled. Read once per
rank and pid (a rank's reports reuse one connection), so the cost is one table read per rank.
"""

from __future__ import annotations

import ipaddress
import os
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


class Connection(NamedTuple):
    """A connection as the sidecar sees it: the client's (host, port), and this sidecar's end of it."""

    host: str
    port: int
    server: tuple[str, int] | None = None


def connection_of(scope: Mapping[str, Any]) -> Connection | None:
    """The connection an ASGI request came on (its `client` and `server`), or None when it has no client."""
    client, server = scope.get("client"), scope.get("server")
    if not client:
        return None
    return Connection(client[0], client[1], (server[0], server[1]) if server else None)


def _address(hex_ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as the kernel's table writes it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def socket_inode(
    host: str, port: int, server: tuple[str, int] | None = None, tables: tuple[str, ...] = TABLES
) -> int | None:
    """The inode of the TCP socket whose local address is (host, port) and, when `server` is given, whose
    remote address is `server`; or None. The remote end matters: Linux gives one ephemeral port to several
    connections to different destinations, so a local address alone can name another process's socket (CI:
    a rank's own post refused as not its own)."""
    wanted, remote = _ip(host), _ip(server[0]) if server else None
    if wanted is None or (server is not None and remote is None):
        return None
    for table in tables:
        try:
            with open(table) as f:
                next(f, None)  # the header
                for line in f:
                    fields = line.split()
                    hex_ip, _, hex_port = fields[1].partition(":")
                    inode = int(fields[9])
                    # inode 0: a socket no process holds any more (TIME_WAIT of an earlier connection
                    # that had the same ephemeral port); the live one is listed too.
                    if not inode or int(hex_port, 16) != port or _address(hex_ip) != wanted:
                        continue
                    if server is not None:
                        rem_ip, _, rem_port = fields[2].partition(":")
                        if int(rem_port, 16) != server[1] or _address(rem_ip) != remote:
                            continue
                    return inode
        except (OSError, ValueError, IndexError):
            continue
    return None


def owns_connection(pid: int, client: Connection | tuple[str, int] | None) -> bool:
    """Whether process `pid` holds the client end of the connection `client`."""
    if client is None or not isinstance(pid, int) or pid <= 1:
        return False
    inode = socket_inode(*client)
    if inode is None:
        return False
    target = f"socket:[{inode}]"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, another user's, or not in this PID namespace
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return True
        except OSError:
            continue
    return False


def process_started(pid: int) -> float | None:
    """When process `pid` started, in unix seconds, as its own collector computes it (the clock now, less
    the machine's uptime, plus the process's start in ticks after boot); None when it is not visible here."""
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # starttime: field 22
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


class Proofs:
    """Which process holds each client connection, proven once per (connection, pid) and kept while the
    connection lasts (the listener says when it closes: forget): a rank posts over one kept-alive
    connection, so a post costs a dict lookup, and a closed connection's port that comes back to another
    process is proven again."""

    MAX_KEPT = 4096

    def __init__(self):
        self._kept: dict[tuple[str, int], dict[int, float | None]] = {}  # client -> {pid: its start, or None}

    def started(self, pid: int | None, client: Connection | None) -> float | None:
        """The start time of `pid` when it holds the connection from `client`; None: not proven (no pid,
        another process's connection, or a pid this sidecar cannot see)."""
        if pid is None or client is None:
            return None
        key = (client[0], client[1])  # as the listener's forget names it
        known = self._kept.get(key)
        if known is not None and pid in known:
            return known[pid]
        start = process_started(pid) if owns_connection(pid, client) else None
        if known is None:
            if len(self._kept) >= self.MAX_KEPT:
                self._kept.clear()
            known = self._kept[key] = {}
        known[pid] = start
        return start

    def forget(self, client: tuple[str, int]) -> None:
        """The connection from `client` closed."""
        self._kept.pop(client, None)
