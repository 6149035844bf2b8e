"""How long each of this node's ranks has waited for a CPU in the stall the leader would judge it by.

On a host so loaded that its ranks wait for a CPU (other jobs, a burst of process start-ups), every step of
a healthy run is slower, and one may pass the hang bound: CI on 4a597bf named a hang when a healthy run's
steps took 8-13x their median for ~11 s. The kernel counts how long each thread was runnable but not
running: its run-queue wait, the second field of /proc/PID/task/TID/schedstat (ns). A rank that is hung is
blocked (in a collective, on a lock, in a sleep) and waits for no CPU; a starved one waits in every thread
its step goes through: the main thread, the one holding the GIL, gloo's (the main thread alone saw ~half of
a starved step's delay: docs/benchmarks.md). So the rank's threads' waits are summed, but for parwatch's own
(named parwatch-*: parwatch/thread_names.py), which wake once a second in a hung rank too and wait on a
loaded host.

The sidecar's tick samples its ranks once a second, right before its digest, in a worker thread (two small
reads a thread: ~0.2 ms for a torch rank's ~15 threads, off the event loop). A row's waits are read from
those samples: since the rank's last boundary (Activity.cpu_wait) and since it entered its open span
(span_cpu_wait: what it waited before it blocked in a span is no part of a stall that names it), each
moment placed between the samples around it. The leader judges a stall without them, within a cap
(sidecar/hang.py). Where the files cannot be read (another pid namespace, a kernel without schedstats)
nothing is reported, and a stall is judged in full, as before.

The same samples give each rank's wait per second lately (per_second), which the straggler attribution sets
against a path's transfers: a starved rank's collectives are slower without any link being slow
(guardrails/attribution.py).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable

from parwatch.thread_names import PREFIX
from parwatch.wire.activity import Activity

SAMPLES_KEPT = 10
"""Samples kept per rank process (10 s at one a tick): a moment older than the oldest is placed at it (less is
counted)."""
_OWN = PREFIX.encode()[:15]


def run_queue_wait(pid: int) -> float | None:
    """Seconds the process's threads (but parwatch's own) have waited for a CPU, summed; None where it cannot
    be read."""
    total, read = 0, False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm", "rb") as f:
                if f.read().startswith(_OWN):
                    continue
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
            read = True
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return total / 1e9 if read else None


class CpuWaits:
    """Per process of this node's ranks: its run-queue wait, sampled by sample() (once a tick, in a thread)."""

    def __init__(self, clock: Callable[[], float], read: Callable[[int], float | None] = run_queue_wait):
        self._clock = clock
        """This host's wall clock: the ranks' step_end and span starts are read on it."""
        self._read = read
        self._lock = threading.Lock()
        self._samples: dict[int, deque[tuple[float, float]]] = {}
        """pid -> [(when, its wait then), ...], oldest first."""
        self._asked: set[int] = set()
        """The processes rows were asked about: sampled until they end, or another run begins."""

    def waited(self, a: Activity) -> tuple[float, float] | None:
        """Seconds rank `a`'s process has waited for a CPU since the boundary its row names (step_end), and
        since the later of that and the start of its open span (since), as of the newest sample; None before
        its first sample or where it cannot be read."""
        with self._lock:
            self._asked.add(a.pid)
            samples = self._samples.get(a.pid)
            if not samples:
                return None
            newest = samples[-1][1]
            span = max((t for t in (a.step_end, a.since) if t is not None), default=None)
            return max(newest - _at(samples, a.step_end), 0.0), max(newest - _at(samples, span), 0.0)

    def per_second(self, pid: int, seconds: float) -> float | None:
        """Seconds process `pid` waited for a CPU per second, over about its last `seconds` (at least the span
        of its two newest samples); None before two samples."""
        with self._lock:
            self._asked.add(pid)
            samples = self._samples.get(pid)
            if not samples or len(samples) < 2:
                return None
            end, newest = samples[-1]
            start = max(min(end - seconds, samples[-2][0]), samples[0][0])
            return (newest - _at(samples, start)) / (end - start) if end > start else None

    def sample(self) -> None:
        """Read every process asked about (blocking: the hub's tick runs it in a worker thread); one that cannot
        be read (it ended) is no longer sampled."""
        with self._lock:
            pids = list(self._asked)
        for pid in pids:
            waited = self._read(pid)  # outside the lock: the event loop never waits on a read
            with self._lock:
                if waited is None:
                    self._asked.discard(pid)
                    self._samples.pop(pid, None)
                elif pid in self._asked:  # not forgotten meanwhile
                    self._samples.setdefault(pid, deque(maxlen=SAMPLES_KEPT)).append((self._clock(), waited))

    def forget(self) -> None:
        """Another run: none of these processes is asked about any more."""
        with self._lock:
            self._asked.clear()
            self._samples.clear()


def _at(samples: deque[tuple[float, float]], when: float | None) -> float:
    """The wait at `when`, between the samples around it (evenly accrued: the guess); the oldest sample's for
    a moment before it or none (less is counted, never more), the newest's for one after it."""
    if when is None or when <= samples[0][0]:
        return samples[0][1]
    before = samples[0]
    for after in samples:
        if after[0] >= when:
            span = after[0] - before[0]
            return before[1] + (after[1] - before[1]) * ((when - before[0]) / span if span > 0 else 1.0)
        before = after
    return samples[-1][1]
