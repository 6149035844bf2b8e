"""One thread per tracker: the event loop hands points over and never waits on a tracker's I/O.

The queue is bounded: when a tracker falls behind (a slow server, a full disk), the oldest point is
dropped and counted, so the newest figures get through and memory stays flat. A tracker that fails
is logged once per kind of failure and counted; the next point tries again (opening the run anew if
it was the opening that failed).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

from parwatch.sidecar.trackers.series import Point
from parwatch.sidecar.trackers.spec import ExportSpec

log = logging.getLogger("parwatch.sidecar.trackers")

MAX_QUEUED = 64
"""Points waiting for one tracker at most (at --export-every 10, 640 steps of lag)."""


class Sink(Protocol):
    """One tracker's writer (tensorboard.py, mlflow.py, wandb.py); only ever called on its worker's thread."""

    def open(self, run_id: str) -> None: ...

    def write(self, point: Point) -> None: ...

    def finish(self) -> None: ...


class TrackerWorker:
    def __init__(self, spec: ExportSpec, make_sink: Callable[[], Sink], max_queued: int = MAX_QUEUED) -> None:
        self.spec = spec
        self._make_sink = make_sink
        self._queue: deque[Point | None] = deque()
        self._max_queued = max_queued
        self._wake = threading.Event()
        self._sink: Sink | None = None
        self._run_id: str | None = None
        self._told: set[str] = set()
        self.written = 0
        """Points the tracker took."""
        self.dropped = 0
        """Points never written: the queue was full (the tracker slower than the run) or the tracker failed."""
        self._thread = threading.Thread(target=self._run, name=f"parwatch-export-{spec.tracker}", daemon=True)
        self._thread.start()

    def put(self, point: Point) -> None:
        """Event loop: queue a point (dropping the oldest when full); returns at once."""
        if len(self._queue) >= self._max_queued:
            try:
                self._queue.popleft()
                self.dropped += 1
            except IndexError:  # the worker took it meanwhile
                pass
        self._queue.append(point)
        self._wake.set()

    def stop(self) -> None:
        """Write what is queued, finish the tracker run, then end the thread (join() waits for it)."""
        self._queue.append(None)
        self._wake.set()

    def join(self, timeout: float) -> bool:
        """False when the thread has not ended within `timeout`."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self, timeout: float = 30.0) -> bool:
        self.stop()
        return self.join(timeout)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while self._queue:
                point = self._queue.popleft()
                if point is None:
                    self._finish()
                    return
                self._write(point)

    def _write(self, point: Point) -> None:
        try:
            if self._run_id != point.run_id:
                self._finish()
                sink = self._make_sink()
                sink.open(point.run_id)
                self._sink, self._run_id = sink, point.run_id
            assert self._sink is not None
            self._sink.write(point)
            self.written += 1
            if point.final:
                self._finish()
        except Exception as exc:  # a tracker's failure never reaches the sidecar
            self.dropped += 1
            self._tell(exc)

    def _finish(self) -> None:
        sink, self._sink, self._run_id = self._sink, None, None
        if sink is not None:
            try:
                sink.finish()
            except Exception as exc:
                self._tell(exc)

    def _tell(self, exc: Exception) -> None:
        kind = type(exc).__name__
        if kind not in self._told:
            self._told.add(kind)
            log.warning("--export %s: %s: %s (logged once; later failures are counted)", self.spec, kind, exc)
