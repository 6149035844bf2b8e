"""parwatch's own threads in a rank, named so the OS shows them (top -H, py-spy, /proc/PID/task/TID/comm): a
node tells them from the rank's own threads when it counts the rank's wait for a CPU (sidecar/cpu_wait.py)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

PREFIX = "parwatch-"
"""Every thread parwatch starts in a rank is named so (the OS keeps 15 bytes of a name)."""
_PR_SET_NAME = 15


def daemon_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """A daemon thread (not started) that names itself `name` for the OS, then runs `target`."""
    if not name.startswith(PREFIX):
        raise ValueError(f"a parwatch thread's name starts with {PREFIX!r}: {name!r}")

    def run() -> None:
        _name_os_thread(name)
        target()

    return threading.Thread(target=run, name=name, daemon=True)


def _name_os_thread(name: str) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the name is Python's only
        pass
