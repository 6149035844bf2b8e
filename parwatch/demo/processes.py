"""Start, watch and stop the demo's child processes (sidecar, trainer)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


class Child:
    """A child process in its own session and process group: stop_all() stops it with its ranks."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict | None = None):
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )

    def poll(self):
        return self.proc.poll()

    def signal_group(self, sig: int) -> bool:
        """Send `sig` to the child's whole process group; False when nothing in it is left.

        The group outlives its leader: the trainer's launcher may be gone while its ranks
        still run, so this asks the group, not the leader."""
        try:
            os.killpg(self.proc.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def group_alive(self) -> bool:
        self.proc.poll()  # reap the leader, so a dead leader does not count as alive
        if not self.signal_group(0):
            return False
        members = live_group_members(self.proc.pid)
        return True if members is None else bool(members)

    def tail(self, lines: int = 5) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def live_group_members(pgid: int) -> list[int] | None:
    """Pids in process group `pgid` that are not zombies, from /proc (None without /proc).

    An orphaned rank that exited stays a zombie until init reaps it, and kill(0) still
    finds it; waiting for it would only add the whole grace period to every stop."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Wait until `url` answers 200 from `proc` itself (the body's pid); RuntimeError if `proc` exits first,
    TimeoutError after `timeout`. Another process answering on a port taken since it was found free is
    waited past: `proc` then fails to bind and exits, and its caller takes other ports."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sidecar exited with {proc.returncode} before answering {url}")
        try:
            answer = httpx.get(url, timeout=1.0)
            if answer.status_code == 200 and answer.json().get("pid") == proc.pid:
                return
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"sidecar did not answer {url} within {timeout:g} s")


def stop_all(children: list[Child], grace_s: float = 10.0) -> None:
    """Stop every child's process group: SIGTERM, then SIGKILL what is left after grace_s.

    All groups are signalled first so their shutdowns overlap. A second Ctrl-C (or SIGTERM)
    while waiting cuts the grace period short but still kills and reaps everything, because
    the children run in their own sessions: nothing else would stop them."""
    for child in children:
        child.signal_group(signal.SIGTERM)
    try:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(child.group_alive() for child in children):
            time.sleep(0.05)
    finally:
        for child in children:
            child.signal_group(signal.SIGKILL)
            try:
                child.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:  # unkillable (D state): nothing more we can do
                pass
            child._log.close()
