"""A free TCP port for a listener: a sidecar's, a demo's, a rendezvous's. The trainer's launcher imports
it too, so it sits here, outside parwatch.demo."""

from __future__ import annotations

import random
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, below the machine's ephemeral range: a port the OS picks (bind to
    0) comes from that range, which every outgoing connection draws its own port from, so one could take it
    before the process bound it, or while it was down for a restart on the same address (a test's leader
    sidecar, killed and started again, found its port held by some client in CI on 343f88b)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768  # Linux's default
    low = max(1024, ephemeral - 16384)
    for _ in range(100):
        port = random.randrange(low, ephemeral)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that range is full: any port the OS has
        s.bind((host, 0))
        return s.getsockname()[1]
