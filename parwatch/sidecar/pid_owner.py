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

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def _address(hex_ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as the kernel's table writes it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def socket_inode(host: str, port: int, tables: tuple[str, ...] = TABLES) -> int | None:
    """The inode of the TCP socket whose local address is (host, port), or None."""
    try:
        wanted = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(wanted, ipaddress.IPv6Address) and wanted.ipv4_mapped is not None:
        wanted = wanted.ipv4_mapped
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
                    if inode and int(hex_port, 16) == port and _address(hex_ip) == wanted:
                        return inode
        except (OSError, ValueError, IndexError):
            continue
    return None


def owns_connection(pid: int, client: tuple[str, int] | None) -> bool:
    """Whether process `pid` holds the client end of the connection from `client` (host, port)."""
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
