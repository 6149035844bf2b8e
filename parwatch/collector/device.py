"""Which span's work a CUDA device is on, from event queries alone (no synchronisation).

The collector's CUDA-event clock records an event at every span's start and end on the rank's stream;
the device reaches them in the order the host recorded them. `event.query()` says, without waiting,
whether the device has reached one. So the span whose start the device has reached and whose end it
has not is the work it is on now (the innermost such span: a TP collective inside a forward). When the
same work stays current across samples, the device has been on it since the first sample that saw it:
a hang whose culprit's host waits (at the boundary, in a collective) while its device is still on one
forward for seconds is the device's, not the host's (parwatch.sidecar.hang's `device` kind).

Only closed spans can show the device behind: a span still open on the host has no end mark yet.
`DeviceProbe.sample` is pure over what it is given (each span's kind and its two marks, each mark
answering `done()`), so tests drive it with recorded event timelines on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

STUCK_SECONDS = 1.0
"""The same work current this long (across samples) is reported: shorter work is the device's normal pace."""


def event_done(mark: Any) -> bool:
    """Whether the device has reached this mark's event (a CudaMark): cudaEventQuery, never a wait."""
    return bool(mark.event.query())


class DeviceProbe:
    """Samples which span's work the device is on; reports it once it stayed current `stuck_seconds`."""

    def __init__(self, stuck_seconds: float = STUCK_SECONDS, done: Callable[[Any], bool] = event_done):
        self.stuck_seconds = stuck_seconds
        self._done = done
        self._work: tuple[int, int] | None = None  # (id of the span's start mark, its recording time) now current
        self._since = 0.0
        self._kind = ""

    def sample(self, spans: Iterable[tuple[str, Any, Any, int]], now: float) -> tuple[str, float] | None:
        """spans: (kind, start mark, end mark or None while open, the start's recording order) of the spans
        the device may still be on. Returns (kind, since) when one span's work has been current for at
        least stuck_seconds (since: the first sample that saw it), else None."""
        current = None
        for kind, start, end, order in sorted(spans, key=lambda s: s[3]):
            try:
                if not self._done(start):
                    break  # the device has not reached this span (nor any later one) yet
                if end is not None and not self._done(end):
                    current = (kind, start, order)  # the latest-starting unfinished span: the innermost work
            except Exception:  # a mark recycled under us: judge at the next sample
                return None
        # A span still open on the host has no end mark: a device that reached its start has caught up
        # with the host (idle, or on work the host has not finished giving it): not stuck behind it.
        if current is None:
            self._work = None
            return None
        kind, start, order = current
        work = (id(start), order)
        if work != self._work:
            self._work, self._since, self._kind = work, now, kind
            return None
        return (self._kind, self._since) if now - self._since >= self.stuck_seconds else None
