"""Which physical host a process runs on: one answer for a rank (what it reports) and its node's
sidecar (whose pids it may signal). Below both the collector and the sidecar."""

from __future__ import annotations

import os
import re
import socket

HOST_ENV = "PARWATCH_HOST"
"""Overrides the host a rank reports (and its node's sidecar takes as its own host)."""
_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,252}$")


def host_identity() -> str:
    """The physical host this process runs on: $PARWATCH_HOST when set, else the hostname.

    Host contention is judged by host (parwatch.guardrails.attribution). In Kubernetes a container's
    hostname is its pod's name, so two pods of one node would read as two hosts and their contention
    would never show: the Helm chart sets PARWATCH_HOST from the downward API (spec.nodeName)."""
    value = os.environ.get(HOST_ENV, "").strip()
    if not value:
        return socket.gethostname()
    if not _HOST_NAME.match(value):
        raise ValueError(
            f"${HOST_ENV}={value!r} must be a host name (letters, digits, '.', '-', '_', ':'; "
            f"at most 253), e.g. the node's name; unset it to use the hostname"
        )
    return value
