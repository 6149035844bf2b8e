"""Start, watch and stop the demo's child processes (sidecar, trainer)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Child:
    """A child process in its own process group, so stopping it stops its ranks too."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict | None = None):
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)

    def poll(self):
        return self.proc.poll()

    def stop(self, grace_s: float = 10.0) -> int | None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def tail(self, lines: int = 5) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def wait_healthy(url: str, child: Child, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"the {child.name} exited with code {child.poll()}:\n{child.tail()}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the {child.name} did not answer {url} within {timeout_s:.0f} s:\n{child.tail()}")
