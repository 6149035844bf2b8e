"""When each of this node's rank processes ended, to the millisecond.

When one rank dies without a word (SIGKILL, os._exit, a segfault), its launcher ends the node's other
workers a few tens of milliseconds later, also without a word. Their last activity samples are up to
a second old, so they cannot tell which process ended first; the exits can. A pidfd (Linux >= 5.3)
becomes readable when its process exits, whoever its parent is: one daemon thread waits on them all
and stamps each exit. Where pidfds are missing, nothing is stamped and the pid check alone tells
that a rank is gone.

Under load the thread wakes late, after two exits tens of milliseconds apart are both ready: one clock
reading for both would tie them. The kernel queues ready pidfds in the order their processes exited,
so every stamp is taken in that order and is later than the one before. Only the lock's holder takes
ready exits off the epoll, and `ended` takes them too, so a stamp asked for never waits on the thread.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable

MAX_WATCHED = 256
"""Processes watched at once (a node runs a handful of ranks); past it, the pid check alone."""

STAMP_STEP = 1e-6
"""How much later than the one before each stamp is, at least: exits seen at one reading keep their order."""


class ProcessExits:
    def __init__(self, clock: Callable[[], float] = time.time):
        self._clock = clock
        self._lock = threading.Lock()
        self._fd_of: dict[int, int] = {}  # pid -> pidfd, while it runs
        self._pid_of: dict[int, int] = {}  # pidfd -> pid
        self._ended: dict[int, float] = {}  # pid -> when it ended
        self._last_stamp = float("-inf")
        self._epoll = select.epoll() if hasattr(os, "pidfd_open") and hasattr(select, "epoll") else None
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, pid: int) -> None:
        """Stamp this process's exit from now on (a no-op when it is watched or already stamped)."""
        if self._epoll is None:
            return
        with self._lock:
            if self._closed or pid in self._fd_of or pid in self._ended or len(self._fd_of) >= MAX_WATCHED:
                return
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # gone already, not permitted, or no pidfd here: the pid check stands
                return
            self._fd_of[pid], self._pid_of[fd] = fd, pid
            self._epoll.register(fd, select.EPOLLIN)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="parwatch-exits", daemon=True)
            self._thread.start()

    def ended(self, pid: int) -> float | None:
        """When the process ended (the sidecar's clock), or None: running, or not watched."""
        if pid in self._fd_of:
            self._take_ready()
        return self._ended.get(pid)

    def drop(self, pid: int) -> None:
        """Stop watching one process and drop its stamp (its rank runs as another process now)."""
        with self._lock:
            self._ended.pop(pid, None)
            fd = self._fd_of.pop(pid, None)
            if fd is not None:
                del self._pid_of[fd]
                self._close(fd)

    def forget(self) -> None:
        """Drop every process and stamp (a new run's ranks are other processes)."""
        with self._lock:
            for fd in self._pid_of:
                self._close(fd)
            self._fd_of, self._pid_of, self._ended = {}, {}, {}

    def close(self) -> None:
        self._closed = True
        self.forget()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._epoll is not None:
            self._epoll.close()

    def _run(self) -> None:
        assert self._epoll is not None
        waiter = select.poll()  # readable while an exit is ready; what is ready is taken under the lock
        waiter.register(self._epoll.fileno(), select.POLLIN)
        while not self._closed:
            try:
                if waiter.poll(500):  # the timeout only lets close() end the thread
                    self._take_ready()
            except (OSError, ValueError):  # closed under it
                return

    def _take_ready(self) -> None:
        """Stamp every exit that is ready, in the order the kernel queued them (the order they ended)."""
        with self._lock:
            if self._closed or self._epoll is None:
                return
            ready = self._epoll.poll(0)
            if not ready:
                return
            now = self._clock()
            for fd, _events in ready:
                pid = self._pid_of.pop(fd, None)
                if pid is not None:
                    del self._fd_of[pid]
                    self._last_stamp = max(now, self._last_stamp + STAMP_STEP)
                    self._ended[pid] = self._last_stamp
                    self._close(fd)

    def _close(self, fd: int) -> None:
        assert self._epoll is not None
        try:
            self._epoll.unregister(fd)
        except (OSError, ValueError):
            pass
        os.close(fd)
