"""A tiny observer registry: the trainer's only window to the outside world.

The trainer knows nothing of parwatch. It announces what it does through this
module: spans (a schedule instruction, a collective, the optimizer), and the
step boundary. An observer (parwatch's collector, or anyone's) registers here.

With no observer registered, `span()` returns one shared no-op context manager
and `emit_*` return at the first `if`: no clock is read, nothing is allocated.

Timing marks come from the registry's clock. On CPU that is
`time.perf_counter_ns`; an observer on GPU installs a clock whose marks are
CUDA events, resolved after the step has finished on the device (no per-op
synchronisation). The trainer never interprets marks itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol


class Clock(Protocol):
    """Produces opaque timing marks; `seconds(start, end)` resolves a pair."""

    def mark(self) -> Any: ...

    def seconds(self, start: Any, end: Any) -> float: ...


class PerfCounterClock:
    """Host clock: marks are `perf_counter_ns` integers."""

    def mark(self) -> int:
        return time.perf_counter_ns()

    def seconds(self, start: int, end: int) -> float:
        return (end - start) * 1e-9


# Span kinds. Compute kinds count as compute; OTHER_KINDS as "other" (optimizer,
# data-parallel gradient sync, checkpoint saves: work that is not the pipeline's
# and must not read as bubble); everything else is communication or waiting.
FORWARD = "forward"
BACKWARD = "backward"
SEND = "send"
RECV = "recv"
COLLECTIVE = "collective"
OPTIMIZER = "optimizer"
DP_SYNC = "dp_sync"
CHECKPOINT = "checkpoint"
BOUNDARY = "boundary"
DATA = "data"  # the data fetch of a microbatch (its own span: slow input is not slow compute)
COMPUTE_KINDS = frozenset({FORWARD, BACKWARD})
OTHER_KINDS = frozenset({OPTIMIZER, DP_SYNC, CHECKPOINT})


@dataclass
class Span:
    """One timed interval. `attrs` holds what the kind needs:

    forward/backward: stage, microbatch, chunk
    send/recv: stage, microbatch, chunk, peer, what ("activation" | "grad"),
               op ("send" | "recv"), group "pp", bytes, group_size 2.
               A send span runs from posting the isend to its completion.
    collective: op, group ("tp" | "pp" | "dp" | "world"), bytes, group_size, seq (the call's number
               on its group), ranks (the group's global ranks, a tuple shared by its calls)
    send/recv also carry seq: the call's number per direction and peer.
    optimizer, dp_sync, checkpoint: stage
    data: stage, microbatch, chunk
    """

    kind: str
    start: Any
    end: Any = None
    attrs: dict = field(default_factory=dict)


@dataclass
class BoundaryInfo:
    """What every rank learns at a step boundary, after the boundary collective.

    `rows[r]` is rank r's trainer slots (see trainer.boundary); each observer
    receives its own slots of every rank beside this object.
    """

    step: int  # the step just finished (0 at the start of training)
    kind: str  # "start" (step 0), "step", "heartbeat" (paused: step repeats), "resume" (after a pause or rollback)
    rows: list  # world_size lists of floats
    loss: float  # the step's loss, as the last stage computed it (mean over DP)
    directive: Any  # trainer.boundary.Directive or None
    start: Any = None  # clock mark when this rank entered the boundary
    end: Any = None  # clock mark when the boundary collective returned


class Observer:
    """Base observer: override what you need. All methods run on the training
    thread and must be quick; heavy work belongs on the observer's own thread."""

    boundary_slots: int = 0  # floats this observer adds to each rank's boundary row

    def on_span(self, span: Span) -> None:
        pass

    def fill_boundary(self, step: int, slots: list) -> None:
        """Write this rank's `boundary_slots` floats for the step-boundary collective."""

    def pending_directive(self):
        """Rank 0 only: a trainer.boundary.Directive to broadcast, or None."""
        return None

    def on_boundary(self, info: BoundaryInfo, slot_rows: list) -> None:
        """`slot_rows[r]`: the `boundary_slots` floats rank r's copy of this observer filled."""

    def on_event(self, name: str, attrs: dict) -> None:
        """Rare events: run_start, checkpoint_saved, directive_applied, paused, run_end."""


class _NullSpan:
    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL_SPAN = _NullSpan()


class _LiveSpan:
    __slots__ = ("_reg", "_span")

    def __init__(self, reg: "HookRegistry", kind: str, attrs: dict):
        self._reg = reg
        self._span = Span(kind, None, None, attrs)

    def __enter__(self):
        self._span.start = self._reg.clock.mark()
        return self._span

    def __exit__(self, *exc):
        span = self._span
        span.end = self._reg.clock.mark()
        for obs in self._reg.observers:
            obs.on_span(span)
        return False


class HookRegistry:
    def __init__(self) -> None:
        self.observers: list[Observer] = []
        self.clock: Clock = PerfCounterClock()
        self.active = False

    def register(self, observer: Observer) -> None:
        self.observers.append(observer)
        self.active = True

    def unregister(self, observer: Observer) -> None:
        self.observers.remove(observer)
        self.active = bool(self.observers)

    def clear(self) -> None:
        self.observers.clear()
        self.clock = PerfCounterClock()
        self.active = False

    def span(self, kind: str, **attrs):
        if not self.active:
            return _NULL_SPAN
        return _LiveSpan(self, kind, attrs)

    def mark(self):
        return self.clock.mark() if self.active else None

    def emit_span(self, kind: str, start, end, **attrs) -> None:
        """Report a span timed elsewhere (an isend, from its post to its completion)."""
        span = Span(kind, start, end, attrs)
        for obs in self.observers:
            obs.on_span(span)

    @property
    def boundary_slots(self) -> int:
        return sum(o.boundary_slots for o in self.observers)

    def fill_boundary(self, step: int, row: list) -> None:
        """`row` is this rank's observer part of its boundary row, zero-filled."""
        offset = 0
        for obs in self.observers:
            n = obs.boundary_slots
            if n:
                part = [0.0] * n
                obs.fill_boundary(step, part)
                row[offset : offset + n] = part
                offset += n

    def pending_directive(self):
        for obs in self.observers:
            d = obs.pending_directive()
            if d is not None:
                return d
        return None

    def emit_boundary(self, info: BoundaryInfo, observer_rows: list) -> None:
        offset = 0
        for obs in self.observers:
            n = obs.boundary_slots
            obs.on_boundary(info, [row[offset : offset + n] for row in observer_rows])
            offset += n

    def emit_event(self, name: str, **attrs) -> None:
        for obs in self.observers:
            obs.on_event(name, attrs)


# One registry per process: a rank is one process.
registry = HookRegistry()
